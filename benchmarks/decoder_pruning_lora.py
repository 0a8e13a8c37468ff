"""Pruning a decoder the way people do it (issue 36): key/value groups chosen by importance, by hard-concrete gates
trained beside LoRA, or at random; then recovery by LoRA or full fine-tuning, each with or without distillation
from the unpruned model; held-out perplexity against the unpruned model given the same recovery, and tokens/s.

For each seed (paired: every arm of a seed sees the same batches) and each sparsity (a quarter and a third of the
key/value groups, chosen globally, at least one group left per layer for importance and random):
- `importance`: head importance (Michel et al. 2019) on the LM loss, a group's score the sum of its query heads';
- `hard_concrete_lora`: `HeadGating(HardConcreteGates, Removal(keep=..., groups=True))` trained beside a LoRA
  adapter on q/k/v/o for `--gate-steps`, the groups removed with the adapter at the end;
- `random`: groups drawn with the seed;
- `uniform`: the same importance scores, the same number of groups from every layer, each layer's least important
  (`attnreg.methods.pruning.select_groups(..., uniform=True)`, the policy `ImportanceRemoval(uniform=True)` uses):
  what a plain transformers checkpoint can hold (`attnreg.export.export_transformers`). Only where the sparsity is a
  whole number of groups per layer (a third of SmolLM2's 3 groups per layer is one; a quarter is not).
Every pruned model and the unpruned control then recover for `--recovery` steps in each way: `lora` (a LoRA
adapter on q/k/v/o and the MLP; the gated run's adapter goes on), `full` (all weights), each plain and `+kd`
(`attnreg.Distillation` from the unpruned model). Perplexity of EWT test sentences; generation speed with the KV
cache at batch 1 and 8 (`decoder_pruning.generation_speed`).

    python benchmarks/decoder_pruning_lora.py --seeds 0 1 2   # SmolLM2-135M; hours on 2 cores
    python benchmarks/decoder_pruning_lora.py --quick         # tiny random Llama, 2 steps, to a temp folder
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import time
import warnings
from pathlib import Path

import lightning as L
import torch
from common import add_output_arguments, output_dir, quick_banner, table, write_results
from decoder_common import (
    builtin_sentences,
    has_ewt,
    lm_batches,
    load_smollm2,
    perplexity,
    quick_model,
    quick_tokenizer,
    read_ewt,
)
from decoder_pruning import PROMPTS, choose_groups, generation_speed, group_scores, speed_prompts
from torch.utils.data import DataLoader

import attnreg
from attnreg.app.modules import CausalLM
from attnreg.hub import is_attached
from attnreg.methods import HardConcreteGates, Removal
from attnreg.methods.pruning import count_parameters, head_importance, prune_heads, select_groups

SPARSITIES = {"quarter": 1 / 4, "third": 1 / 3}
RECOVERIES = ["lora", "lora+kd", "full", "full+kd"]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def fit(model, batches, steps, lr, seed, callbacks=(), gate_lr=None) -> float:
    """Train `model` in place as a causal LM on `batches` (AdamW, constant rate, clip 1) under Lightning with the
    attnreg `callbacks`; returns the seconds it took."""
    L.seed_everything(seed, workers=True, verbose=False)
    module = CausalLM(model, lr=lr, weight_decay=0.0, warmup=0.0, schedule="constant", gate_lr=gate_lr)
    trainer = L.Trainer(
        max_steps=steps, gradient_clip_val=1.0, callbacks=list(callbacks), logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, devices=1,
    )  # fmt: skip
    started = time.perf_counter()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        trainer.fit(module, train_dataloaders=DataLoader(batches, batch_size=None))
    model.eval()
    return time.perf_counter() - started


def with_lora(model, rank: int, seed: int, mlp: bool = True):
    import peft

    torch.manual_seed(seed)
    targets = ATTENTION + (["gate_proj", "up_proj", "down_proj"] if mlp else [])
    return peft.get_peft_model(model, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets))


def random_groups(layers: int, groups: int, fraction: float, seed: int) -> dict[int, list[int]]:
    """`fraction` of all key/value groups at random, at least one left in every layer."""
    scores = {
        layer: [random.Random(seed * 1000 + layer * 10 + g).random() for g in range(groups)] for layer in range(layers)
    }
    return choose_groups(scores, "global", fraction)


def gated_choice(base, batches, args, seed: int, keep: int):
    """Hard-concrete gates on whole key/value groups trained beside LoRA; the groups go with the adapter at the end.
    Returns the pruned PEFT model (its adapter goes on in LoRA recovery)."""
    model = with_lora(copy.deepcopy(base), args.rank, seed, mlp=False)
    gating = attnreg.HeadGating(HardConcreteGates(target_warmup=0.5), Removal(keep=keep, groups=True))
    fit(model, batches[: args.gate_steps], args.gate_steps, args.lora_lr, seed, [gating], gate_lr=args.gate_lr)
    return model


def recover(pruned, base, kind: str, batches, args, seed: int):
    """A recovered copy of `pruned` (a plain model, or a PEFT model from the gated run), merged for evaluation."""
    model = copy.deepcopy(pruned)
    callbacks = [attnreg.Distillation(teacher=copy.deepcopy(base))] if kind.endswith("+kd") else []
    if kind.startswith("full"):
        model = model.merge_and_unload() if hasattr(model, "merge_and_unload") else model
        model.requires_grad_(True)
        seconds = fit(model, batches, args.recovery, args.lr, seed, callbacks)
    else:
        model = model if hasattr(model, "merge_and_unload") else with_lora(model, args.rank, seed)
        seconds = fit(model, batches, args.recovery, args.lora_lr, seed, callbacks)
        model = model.merge_and_unload()
    if is_attached(model):
        attnreg.detach(model)
    return model.eval(), seconds


# Settings that change a figure: a run folder's results are merged only with a run of the same ones.
RESULT_SETTINGS = ("quick", "importance", "gate_steps", "recovery", "batch", "lr", "lora_lr", "gate_lr", "rank",
                   "max_length", "eval")  # fmt: skip
CHOICES = ["importance", "uniform", "hard_concrete_lora", "random"]


def previous(out, args) -> dict:
    """The results of earlier runs in `out` (results.json), or {} if none; exits naming the first setting that
    differs, so that no cell mixes figures made differently.

    Example:
        >>> import tempfile, argparse
        >>> args = argparse.Namespace(**{name: 1 for name in RESULT_SETTINGS})
        >>> previous(Path(tempfile.mkdtemp()), args)
        {}
    """
    path = Path(out) / "results.json"
    if not path.is_file():
        return {}
    report = json.loads(path.read_text())
    before = report.get("meta", {}).get("settings", {})
    for name in RESULT_SETTINGS:
        now = json.loads(json.dumps(getattr(args, name)))
        if before.get(name) != now:
            raise SystemExit(
                f"{path} was made with --{name.replace('_', '-')} {before.get(name)}, this run has {now}: its figures"
                " would not compare; use another --run (or --out), or the same setting"
            )
    report.pop("meta")
    return report


def cell(report: dict, seed: str, sparsity: str, choice: str, kind: str) -> float | None:
    """The perplexity of one recovery arm (`choice` "" for the unpruned model), or None if not run yet."""
    entry = report["perplexity"].get(seed, {}).get(sparsity, {})
    return entry.get(kind) if sparsity == "unpruned" else entry.get(choice, {}).get(kind)


def markdown(report: dict, args) -> str:
    """The ratio table over every seed that has both the pruned arm and the unpruned one (the count in each
    cell: a partial grid says how many seeds each cell holds), the unpruned perplexities, and the speed."""
    setup = report["setup"]
    lines = [f"# Pruning a decoder with LoRA ({setup['model']})", "", *quick_banner(args.quick)]
    seeds = sorted(report["perplexity"], key=int)
    sparsities = [name for name in SPARSITIES if any(name in report["perplexity"][s] for s in seeds)]
    kinds = [kind for kind in RECOVERIES if any(cell(report, s, "unpruned", "", kind) for s in seeds)]
    lines += [
        f"Seeds {', '.join(seeds) or 'none finished yet'}; gates trained {args.gate_steps} steps beside LoRA"
        f" r={args.rank}; recovery"
        f" {args.recovery} steps of {args.batch} sentences; perplexity on {setup['eval_sentences']} EWT test sentences."
        " Ratio: pruned perplexity over the unpruned model's after the same recovery (same seed, same batches), mean"
        " (min-max) over the seeds that have both, their count after `n=`; `-`: not run yet.",
        "",
    ]
    rows = []
    for sparsity in sparsities:
        for choice in CHOICES:
            row = [f"{sparsity} ({setup['removed'][sparsity]}/{setup['layers'] * setup['kv_groups']})", choice]
            for kind in kinds:
                ratios = [
                    cell(report, s, sparsity, choice, kind) / cell(report, s, "unpruned", "", kind)
                    for s in seeds
                    if cell(report, s, sparsity, choice, kind) and cell(report, s, "unpruned", "", kind)
                ]
                if not ratios:
                    row.append("-")
                elif len(ratios) == 1:
                    row.append(f"{ratios[0]:.3f} (n=1)")
                else:
                    row.append(f"{statistics.mean(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}, n={len(ratios)})")
            if any(value != "-" for value in row[2:]):  # a choice this run's settings leave out has no row
                rows.append(row)
    lines += table(["groups removed", "choice", *kinds], rows)
    unpruned = [["unpruned", *[f"{cell(report, s, 'unpruned', '', k) or float('nan'):.2f}" for k in kinds]]
                for s in seeds]  # fmt: skip
    lines += ["", "Perplexity of the unpruned model after each recovery, per seed:", ""]
    lines += table(["seed", *kinds], [[s, *row[1:]] for s, row in zip(seeds, unpruned, strict=True)])
    speed = report.get("speed") or {}
    if speed:
        lines += ["", "Tokens/s (greedy, KV cache; the importance choice of the first seed), ratio to unpruned:", ""]
        lines += table(
            ["model", "parameters", "batch 1", "batch 8"],
            [
                [name, f"{report['parameters'][name] / 1e6:.2f}M"]
                + [f"{speed[name][b]['tokens_per_s']:.1f} ({speed[name][b]['ratio']:.2f}x)" for b in ("1", "8")]
                for name in speed
            ],
        )
    seconds = report.get("arm_seconds", {})
    if seconds:
        lines += ["", f"Compute: {len(seconds)} arms, {sum(seconds.values()) / 3600:.2f} h of training and evaluation"
                  f" ({statistics.mean(seconds.values()):.0f} s per arm)."]  # fmt: skip
    return "\n".join(lines) + "\n"


def pruned_by_groups(base, removed: dict[int, list[int]], per_group: int):
    """A copy of `base` without the key/value groups `removed` ({layer: [group]}) and their query heads."""
    model = copy.deepcopy(base)
    prune_heads(
        model, {layer: [g * per_group + i for g in gs for i in range(per_group)] for layer, gs in removed.items()}
    )
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--importance", type=int, default=64, help="training sentences for head importance")
    parser.add_argument("--gate-steps", type=int, default=100)
    parser.add_argument("--recovery", type=int, default=40)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-4, help="full fine-tuning")
    parser.add_argument("--lora-lr", type=float, default=1e-3)
    parser.add_argument("--gate-lr", type=float, default=0.5)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--eval", type=int, default=500)
    parser.add_argument("--repetitions", type=int, default=5, help="of the speed measurement (0: none)")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--sparsities", nargs="+", choices=list(SPARSITIES), default=list(SPARSITIES))
    parser.add_argument("--recoveries", nargs="+", choices=RECOVERIES, default=RECOVERIES)
    parser.add_argument("--choices", nargs="+", choices=CHOICES, default=CHOICES)
    add_output_arguments(parser, "tiny random Llama, 2 steps each, one seed")
    args = parser.parse_args()
    args.out = output_dir(args, "decoder_pruning_lora")
    if args.quick:
        args.seeds, args.importance, args.gate_steps, args.recovery, args.repetitions = [0], 8, 2, 2, 1
        args.sparsities, args.recoveries = ["quarter"], ["lora", "full+kd"]
    if args.threads:
        torch.set_num_threads(args.threads)
    report = previous(args.out, args)  # exits before the model loads if the settings differ
    earlier_seconds = report.get("seconds", 0.0)
    started = time.perf_counter()
    if args.quick:
        pool = read_ewt("train", 64, min_words=5) if has_ewt() else builtin_sentences(64, seed=10)
        test = read_ewt("test", 16, min_words=3) if has_ewt() else builtin_sentences(16, seed=12)
        tokenizer = quick_tokenizer([s.text for s in pool + test] + PROMPTS)
        base, description = quick_model(tokenizer, layers=2, heads=6, hidden=48), "tiny random Llama"
    else:
        base, tokenizer = load_smollm2()
        pool, test = read_ewt("train", min_words=5), read_ewt("test", args.eval, min_words=2)
        description = "SmolLM2-135M-Instruct, float32"
    config = base.config
    layers, groups = config.num_hidden_layers, config.num_key_value_heads
    per_group = config.num_attention_heads // groups
    removed_count = {name: round(fraction * layers * groups) for name, fraction in SPARSITIES.items()}
    test_texts = [s.text for s in test]
    report.setdefault("perplexity", {})
    report.setdefault("arm_seconds", {})
    report["setup"] = {"model": description, "layers": layers, "kv_groups": groups, "removed": removed_count,
                       "eval_sentences": len(test_texts), "threads": torch.get_num_threads(),
                       "quick": args.quick}  # fmt: skip

    def save() -> None:
        report["seconds"] = round(earlier_seconds + time.perf_counter() - started, 1)
        write_results(args.out, report, markdown(report, args), args)

    def schedule(seed: int) -> tuple:
        order = random.Random(seed).sample(range(len(pool)), len(pool))
        texts = [pool[i].text for i in order]
        needed = args.importance + (args.gate_steps + args.recovery) * args.batch
        texts = [texts[i % len(texts)] for i in range(needed)]
        importance = lm_batches(tokenizer, texts[: args.importance], args.batch, args.max_length)
        gate_texts = texts[args.importance :][: args.gate_steps * args.batch]
        gate_batches = lm_batches(tokenizer, gate_texts, args.batch, args.max_length)
        recovery_batches = lm_batches(tokenizer, texts[-args.recovery * args.batch :], args.batch, args.max_length)
        return importance, gate_batches, recovery_batches

    scores = {}  # seed -> key/value group scores by head importance on the seed's importance batches

    def importance_groups(seed: int) -> dict:
        if seed not in scores:
            batches = schedule(seed)[0]
            scores[seed] = group_scores(head_importance(copy.deepcopy(base), batches), groups)
        return scores[seed]

    # Speed depends on the architecture only: the unpruned model and each sparsity's importance choice (first seed),
    # measured once per sparsity and kept across resumed runs.
    speed_sparsities = [name for name in SPARSITIES if name in args.sparsities or name in report.get("speed", {})]
    if args.repetitions and any(name not in report.get("speed", {}) for name in speed_sparsities):
        by_group = importance_groups(min(args.seeds))
        kept = {"unpruned": base}
        for name in speed_sparsities:
            kept[name] = pruned_by_groups(base, choose_groups(by_group, "global", SPARSITIES[name]), per_group)
        prompts = speed_prompts(tokenizer, test_texts, 16)
        report["speed"] = generation_speed(kept, prompts, 32 if not args.quick else 4, args.repetitions)
        report["parameters"] = {name: count_parameters(model) for name, model in kept.items()}
        del kept
        save()

    arms = [("unpruned", "", kind) for kind in args.recoveries]
    arms += [
        (sparsity, choice, kind)
        for sparsity in args.sparsities
        for choice in args.choices
        if choice != "uniform" or removed_count[sparsity] % layers == 0
        for kind in args.recoveries
    ]
    for seed in args.seeds:
        todo = [arm for arm in arms if cell(report, str(seed), *arm) is None]
        print(f"seed {seed}: {len(arms) - len(todo)} arms done before, {len(todo)} to run", flush=True)
        if not todo:
            continue
        _, gate_batches, recovery_batches = schedule(seed)
        by_group = importance_groups(seed) if any(c in ("importance", "uniform") for _, c, _ in todo) else None
        pruned = {}  # (sparsity, choice) -> the model that recovers, built when its first arm runs
        for sparsity, choice, kind in todo:
            if (sparsity, choice) not in pruned:
                pruned.clear()  # one pruned model in memory at a time
                fraction = SPARSITIES.get(sparsity)
                if sparsity == "unpruned":
                    pruned[sparsity, choice] = base
                elif choice == "importance":
                    removed = choose_groups(by_group, "global", fraction)
                    pruned[sparsity, choice] = pruned_by_groups(base, removed, per_group)
                elif choice == "uniform":
                    scored = {layer: torch.tensor(values) for layer, values in by_group.items()}
                    keep = layers * groups - removed_count[sparsity]
                    heads = select_groups(scored, dict.fromkeys(scored, 1), keep=keep, uniform=True)
                    pruned[sparsity, choice] = pruned_by_groups(base, heads, per_group)
                elif choice == "random":
                    removed = random_groups(layers, groups, fraction, seed)
                    pruned[sparsity, choice] = pruned_by_groups(base, removed, per_group)
                else:
                    gate_started = time.perf_counter()
                    keep = layers * groups - removed_count[sparsity]
                    pruned[sparsity, choice] = gated_choice(base, gate_batches, args, seed, keep)
                    gate_seconds = time.perf_counter() - gate_started
                    report["arm_seconds"][f"{seed}/{sparsity}/{choice}/gates"] = round(gate_seconds, 1)
            arm_started = time.perf_counter()
            model, seconds = recover(pruned[sparsity, choice], base, kind, recovery_batches, args, seed)
            value = perplexity(model, tokenizer, test_texts, 32, args.max_length)["perplexity"]
            del model
            entry = report["perplexity"].setdefault(str(seed), {}).setdefault(sparsity, {})
            if sparsity == "unpruned":
                entry[kind] = value
            else:
                entry.setdefault(choice, {})[kind] = value
            report["arm_seconds"][f"{seed}/{sparsity}/{choice or '-'}/{kind}"] = round(
                time.perf_counter() - arm_started, 1
            )
            print(f"seed {seed} {sparsity} {choice} {kind}: {value:.2f} (recovery {seconds:.0f} s)", flush=True)
            save()
    save()
    print(markdown(report, args))


if __name__ == "__main__":
    main()
