"""Print the serving image's third-party requirements, read from pyproject.toml.

The image installs these in their own layer before the source is copied in, so that editing the
code does not re-download the dependencies. `--onnxruntime SPEC` swaps the CPU `onnxruntime` for
another distribution of the same module (the GPU image passes `onnxruntime-gpu[cuda,cudnn]==...`).

    python3 docker/requirements.py [--onnxruntime SPEC] [PYPROJECT]
    python3 docker/requirements.py --extra torch     # one optional-dependency list only
"""

import argparse
import re
import tomllib


def serve_requirements(pyproject: dict, onnxruntime: str | None = None) -> list[str]:
    project = pyproject["project"]
    requirements = list(project["dependencies"]) + list(project["optional-dependencies"]["serve"])
    if onnxruntime:
        requirements = [r for r in requirements if re.split(r"[\s<>=!~\[;]", r, 1)[0] != "onnxruntime"]
        requirements.append(onnxruntime)
    return requirements


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pyproject", nargs="?", default="pyproject.toml")
    parser.add_argument("--onnxruntime", default=None, help="replacement for the onnxruntime requirement")
    parser.add_argument("--extra", default=None, help="print this optional-dependency list instead")
    args = parser.parse_args()
    with open(args.pyproject, "rb") as f:
        pyproject = tomllib.load(f)
    if args.extra:
        requirements = pyproject["project"]["optional-dependencies"][args.extra]
    else:
        requirements = serve_requirements(pyproject, args.onnxruntime)
    print("\n".join(requirements))


if __name__ == "__main__":
    main()
