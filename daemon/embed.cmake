# embed.cmake - writes a C file that holds a text file as a NUL-terminated char array.
# Run as: cmake -DIN=file -DOUT=file.c -DNAME=symbol -P embed.cmake
# (kdad compiles config/kdad.yaml in this way as its built-in default configuration.)
file(READ "${IN}" hex HEX)
string(LENGTH "${hex}" digits)
math(EXPR len "${digits} / 2")
string(REGEX REPLACE "([0-9a-f][0-9a-f])" "0x\\1," bytes "${hex}")
# 16 bytes per line keeps the generated file readable in a diff or an editor
string(REGEX REPLACE "((0x..,){16})" "\\1\n    " bytes "${bytes}")
file(WRITE "${OUT}"
  "/* Generated from ${IN} by daemon/embed.cmake: do not edit. */\n"
  "#include <stddef.h>\n\n"
  "const char ${NAME}[] = {\n    ${bytes}0x00};\n"
  "const size_t ${NAME}_len = ${len};\n")
