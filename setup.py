"""Builds the optional C extensions under native/.

Each native module has a pure-Python twin in edgespec/, so an install without a compiler
still works; the build failure is reported, not fatal.
"""
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    """build_ext that warns instead of failing when a C compiler is missing or errors."""

    def run(self):
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - any compiler failure means "use the twin"
            self.warn(f"edgespec: native extensions not built ({exc}); using pure-Python twins")

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001
            self.warn(f"edgespec: {ext.name} not built ({exc}); using its pure-Python twin")


setup(
    ext_modules=[
        Extension("edgespec._native_tokens", sources=["native/tokens.c"], optional=True,
                  extra_compile_args=["-O3"]),
        Extension("edgespec._native_suffix", sources=["native/suffix.c"], optional=True,
                  extra_compile_args=["-O3"]),
    ],
    cmdclass={"build_ext": OptionalBuildExt},
)
