"""Imported at start-up by every Python child of a `model_free` test (tests/conftest.py puts this
folder first on the child's PYTHONPATH): loading a model there ends the child with exit code 99
and a line on stderr, so a model-free test that starts a model-loading command fails."""
import importlib.abc
import importlib.util
import os
import sys

EXIT_CODE = 99


class _RefuseModelLoads(importlib.abc.MetaPathFinder):
    """Patches LlamaModel's constructor once edgespec.llama.backend is imported (not before:
    importing it here would change the child's import order and start-up time)."""

    def find_spec(self, name, path=None, target=None):
        if name != "edgespec.llama.backend":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)

            def refuse(model, path, *args, **kwargs):
                sys.stderr.write(f"a model_free test's child process loads a model: {path}\n")
                sys.stderr.flush()
                os._exit(EXIT_CODE)

            module.LlamaModel.__init__ = refuse

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _RefuseModelLoads())
