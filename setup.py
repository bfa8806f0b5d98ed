"""The build hook; everything else is in pyproject.toml.

It records the commit the package is built from (``ggml_attn/_build_info.py``, read by
``ggml_attn._build.build_info``: llama-bench's ``build_commit``/``build_number`` and ``--version``), since
an installed copy has no .git to ask:

* ``sdist``: into the sdist (its release tree, not the checkout), so a wheel built from the
  sdist, where there is no .git, keeps the commit;
* ``build_py`` (wheels, ``pip install .``): into the built package, from git or
  ``GGML_ATTN_COMMIT``; without either (an unpacked sdist) the sdist's record is built as it is.
  An editable install records nothing: it asks git at run time.
"""
import importlib.util
import os

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

ROOT = os.path.dirname(os.path.abspath(__file__))


def _build_module():
    """ggml_attn/_build.py by its path: importing the package would import numpy and ggml."""
    spec = importlib.util.spec_from_file_location("_ggml_attn_build", os.path.join(ROOT, "ggml_attn", "_build.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _record(package_dir: str) -> None:
    build = _build_module()
    info = build.at_build_time(ROOT)
    if info is not None and os.path.isdir(package_dir):
        build.write_record(package_dir, info)


class BuildPy(build_py):
    def run(self):
        super().run()
        if not getattr(self, "editable_mode", False):
            _record(os.path.join(self.build_lib, "ggml_attn"))


class Sdist(sdist):
    def make_release_tree(self, base_dir, files):
        super().make_release_tree(base_dir, files)
        _record(os.path.join(base_dir, "ggml_attn"))


setup(cmdclass={"build_py": BuildPy, "sdist": Sdist})
