"""The native builds a test can load here: every variant this CPU runs, and the scalar reference,
which any CPU runs (the builds must give its bits)."""

from serve.model import native_build

VARIANTS = native_build.supported()
BUILDS = [*VARIANTS, native_build.REFERENCE]


def load_build(name):
    return native_build.load_reference() if name == native_build.REFERENCE else native_build.load_variant(name)
