"""Import every module of the installed attnreg and every name its `__all__` lists (scripts/check_wheel.sh runs it
in a fresh venv, from an empty folder). Fails when attnreg is imported from anywhere but that venv's site-packages,
when a module does not import, or when a listed name does not resolve. A module that needs an extra the venv lacks
(`attnreg.app.cli.EXTRAS`) is reported and passed over: the wheel is installed with the README's extras only.

    python scripts/check_public_names.py
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import sysconfig
import warnings
from pathlib import Path

import attnreg
from attnreg.app.cli import EXTRAS

# The moved-module shims (attnreg/configs.py, ...) warn and replace themselves with their new module on import.
SHIMS = {f"attnreg.{name}" for name in attnreg.MOVED}


def main() -> int:
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    where = Path(attnreg.__file__).resolve()
    if site not in where.parents:
        print(f"attnreg is imported from {where}, not from this venv's {site}", file=sys.stderr)
        return 1
    failures, passed_over, names = [], [], 0
    modules = ["attnreg", *(info.name for info in pkgutil.walk_packages(attnreg.__path__, "attnreg."))]
    for name in modules:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the moved modules' FutureWarning, third parties' own
                module = importlib.import_module(name)
        except ImportError as error:
            package = (error.name or "").split(".")[0]
            if package in EXTRAS:
                passed_over.append(f"{name} (needs {package}: attnreg[{EXTRAS[package]}])")
                continue
            failures.append(f"import {name}: {error!r}")
            continue
        except Exception as error:  # every failure is listed, then the script fails
            failures.append(f"import {name}: {error!r}")
            continue
        if name in SHIMS:
            continue
        for public in getattr(module, "__all__", ()):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    getattr(module, public)
                names += 1
            except Exception as error:
                failures.append(f"{name}.{public}: {error!r}")
    print(f"{len(modules)} modules of attnreg {attnreg.__version__} from {where.parent}, {names} public names")
    for line in passed_over:
        print(f"  passed over {line}")
    for line in failures:
        print(f"  FAILED {line}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
