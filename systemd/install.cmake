# install.cmake - run by `cmake --install` (systemd/CMakeLists.txt sets the KDAD_* inputs).
#
# Everything here depends on the install-time prefix (CMAKE_INSTALL_PREFIX, which
# `cmake --install --prefix` replaces), hence an install script rather than configure-time
# install() rules.  DESTDIR is honoured by file(INSTALL); the existence check of the
# configuration file adds it by hand.

# An install directory: absolute as given, else under the prefix (GNUInstallDirs' rules,
# including /etc for the prefixes / and /usr).
function(kdad_dir out rel kind)
  if(IS_ABSOLUTE "${rel}")
    set(dir "${rel}")
  elseif(kind STREQUAL "sysconf" AND CMAKE_INSTALL_PREFIX MATCHES "^/(usr/?)?$")
    set(dir "/${rel}")
  elseif(kind STREQUAL "sysconf" AND CMAKE_INSTALL_PREFIX MATCHES "^/opt/")
    set(dir "/${rel}${CMAKE_INSTALL_PREFIX}")
  elseif(CMAKE_INSTALL_PREFIX STREQUAL "/")
    set(dir "/usr/${rel}")
  else()
    set(dir "${CMAKE_INSTALL_PREFIX}/${rel}")
  endif()
  string(REGEX REPLACE "//+" "/" dir "${dir}")
  set(${out} "${dir}" PARENT_SCOPE)
endfunction()

kdad_dir(unitdir "${KDAD_SYSTEMD_UNITDIR}" lib)
kdad_dir(sysusersdir "${KDAD_SYSUSERSDIR}" lib)
kdad_dir(tmpfilesdir "${KDAD_TMPFILESDIR}" lib)
kdad_dir(sbindir "${KDAD_SBINDIR}" bin)
kdad_dir(sysconfdir "${KDAD_SYSCONFDIR}" sysconf)
kdad_dir(docdir "${KDAD_DOCDIR}" doc)

set(KDAD_CONFIG_FILE "${sysconfdir}/kdad/kdad.yaml")
set(KDAD_SBINDIR "${sbindir}")
set(KDAD_SYSCONFDIR "${sysconfdir}")
set(KDAD_DOCDIR "${docdir}")
# One copy per prefix: installs for different prefixes may run at once (the tests do).
# kdad.service for one GPU, the kdad@.service template for one kdad per GPU.
string(MD5 tag "${CMAKE_INSTALL_PREFIX}")
set(units)
foreach(name kdad.service kdad@.service)
  configure_file("${KDAD_SOURCE_DIR}/systemd/${name}.in" "${KDAD_BINARY_DIR}/prefix-${tag}/${name}"
                 @ONLY)
  list(APPEND units "${KDAD_BINARY_DIR}/prefix-${tag}/${name}")
endforeach()

file(INSTALL ${units} "${KDAD_SOURCE_DIR}/systemd/kdad.socket"
     "${KDAD_SOURCE_DIR}/systemd/kdad@.socket" DESTINATION "${unitdir}"
     FILE_PERMISSIONS OWNER_READ OWNER_WRITE GROUP_READ WORLD_READ)
file(INSTALL "${KDAD_SOURCE_DIR}/systemd/kdad.sysusers" DESTINATION "${sysusersdir}"
     RENAME kdad.conf FILE_PERMISSIONS OWNER_READ OWNER_WRITE GROUP_READ WORLD_READ)
file(INSTALL "${KDAD_SOURCE_DIR}/systemd/kdad.tmpfiles" DESTINATION "${tmpfilesdir}"
     RENAME kdad.conf FILE_PERMISSIONS OWNER_READ OWNER_WRITE GROUP_READ WORLD_READ)

# The operator's configuration is theirs: installed once, never overwritten.  The default
# it started from stays readable in the docs folder (kdad.yaml there).
if(EXISTS "$ENV{DESTDIR}${KDAD_CONFIG_FILE}")
  message(STATUS "Keeping: $ENV{DESTDIR}${KDAD_CONFIG_FILE} (it exists; the default is "
                 "$ENV{DESTDIR}${docdir}/kdad.yaml)")
else()
  file(INSTALL "${KDAD_SOURCE_DIR}/config/kdad.yaml" DESTINATION "${sysconfdir}/kdad"
       FILE_PERMISSIONS OWNER_READ OWNER_WRITE GROUP_READ WORLD_READ)
endif()
