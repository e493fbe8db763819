"""Builds kdaclient: a CPython extension (stable ABI, abi3) over libkdaclient.

libkdaclient and its protocol codec are compiled from this repository's
sources (client/src, proto/) straight into the extension, with hidden
symbols, and msgpack-c is linked statically where its archive exists, so the
module depends on nothing but libc at run time.  The version is the
library's, read from client/include/kdaclient.h.
"""
import os
import re

from setuptools import Extension, setup

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# Py_LIMITED_API 3.11: the buffer protocol joined the stable ABI there.
LIMITED_API = 0x030B0000


def kda_proto_sources():
    """kda_proto's sources, as proto/CMakeLists.txt lists them (one list to keep)."""
    with open(os.path.join(ROOT, "proto", "CMakeLists.txt")) as f:
        text = f.read()
    return re.search(r"add_library\(kda_proto STATIC([^)]*)\)", text).group(1).split()


PROTO_SOURCES = kda_proto_sources()
CLIENT_SOURCES = sorted(f for f in os.listdir(os.path.join(ROOT, "client", "src")) if f.endswith(".c"))
MODULE_SOURCES = ["module.c", "client_type.c", "tensors.c", "cuda.c", "results.c", "step.c",
                  "ordered.c"]
MSGPACK_ARCHIVES = ["/usr/lib/x86_64-linux-gnu/libmsgpackc.a",
                    "/usr/lib/aarch64-linux-gnu/libmsgpackc.a", "/usr/lib/libmsgpackc.a"]


def library_version():
    with open(os.path.join(ROOT, "client", "include", "kdaclient.h")) as f:
        text = f.read()
    part = {k: re.search(r"#define KDAC_VERSION_%s (\d+)" % k, text).group(1)
            for k in ("MAJOR", "MINOR", "PATCH")}
    return "%s.%s.%s" % (part["MAJOR"], part["MINOR"], part["PATCH"])


def rel(*parts):
    # setuptools wants source paths relative to setup.py
    return os.path.relpath(os.path.join(*parts), HERE)


def msgpack_link():
    for a in MSGPACK_ARCHIVES:
        if os.path.exists(a):
            return [a], []
    return [], ["msgpackc"]


objects, libraries = msgpack_link()
ext = Extension(
    "kdaclient._kdaclient",
    sources=[rel(HERE, "src", s) for s in MODULE_SOURCES]
    + [rel(ROOT, "client", "src", s) for s in CLIENT_SOURCES]
    + [rel(ROOT, "proto", s) for s in PROTO_SOURCES],
    include_dirs=[os.path.join(ROOT, "client", "include"), os.path.join(ROOT, "client", "src"),
                  os.path.join(ROOT, "proto"), os.path.join(ROOT, "proto", "private")],
    define_macros=[("Py_LIMITED_API", hex(LIMITED_API)), ("KDAC_STATIC", "1")],
    extra_compile_args=["-std=gnu11", "-fvisibility=hidden", "-Wall", "-Wno-unused-parameter",
                        "-Wno-sign-compare", "-Wno-missing-field-initializers"],
    extra_link_args=["-Wl,--exclude-libs,ALL", "-Wl,-z,noexecstack"],
    extra_objects=objects,
    libraries=libraries + ["dl"],
    py_limited_api=True,
)

setup(
    name="kdaclient",
    version=library_version(),
    description="Python client of kdad, the Kimi Delta Attention prefill daemon",
    packages=["kdaclient", "kdaclient_tests"],
    package_data={"kdaclient": ["py.typed", "*.pyi"]},
    ext_modules=[ext],
    python_requires=">=3.11",
    install_requires=[],
    options={"bdist_wheel": {"py_limited_api": "cp311"}},
)
