"""setuptools' build step for longdoc-models (the project is pyproject.toml): every build starts
from an empty build/lib/longdoc_models, because setuptools packs whatever an earlier build left
there, so a model directory deleted from models/ stayed in the next wheel; and this file, in the
package's own directory, is not one of its modules."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class FreshBuildPy(build_py):
    def run(self):
        shutil.rmtree(Path(self.build_lib) / "longdoc_models", ignore_errors=True)
        super().run()

    def find_package_modules(self, package, package_dir):
        return [m for m in super().find_package_modules(package, package_dir) if m[1] != "setup"]


setup(cmdclass={"build_py": FreshBuildPy})
