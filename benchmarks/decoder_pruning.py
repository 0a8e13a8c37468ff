"""Head pruning of a real decoder: SmolLM2-135M, key/value groups chosen by head importance, removed physically,
a short recovery fine-tune, then held-out perplexity, generation speed with a KV cache and greedy generations.

Head importance (Michel et al. 2019: mean |dL/dg| of a gate at 1 on each head, L2-normalised per layer;
`attnreg.methods.pruning.head_importance`) on the LM loss of EWT training sentences; a key/value group's score is
the sum over its query heads. A grouped-query model can lose a key/value head only with all its query heads, so
removal is by group (`prune_heads` with the group's heads). Two sparsities, a third of the heads each:
- `group_per_layer`: the least important of the 3 key/value groups in every layer;
- `global_third`: the least important third of all groups, chosen globally (at most 2 of 3 per layer).
Each pruned model, and the unpruned one as the control, is then fine-tuned for `--recovery` steps as a causal LM
on the same EWT training batches (AdamW, all weights). Perplexity of EWT test sentences before and after;
generation speed: greedy `generate` with the KV cache, batch 1 and 8, prompts of equal length, repetitions
interleaved across the models, medians and ratios to the unpruned model in the same run.

    python benchmarks/decoder_pruning.py              # SmolLM2-135M, 40 recovery steps of 8 sentences
    python benchmarks/decoder_pruning.py --quick      # tiny random Llama, a few sentences, to a temp folder
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import numpy as np
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
from torch.utils.data import DataLoader

from attnreg.app.train import fit_causal_lm
from attnreg.methods.pruning import count_parameters, head_importance, prune_heads, pruned_heads

PROMPTS = [
    "The capital of France is",
    "My favourite food is",
    "To make a cup of tea, you",
    "The best thing about living in a small town is",
]


def group_scores(scores: dict[int, torch.Tensor], groups: int) -> dict[int, list[float]]:
    """Per layer, each key/value group's importance: the sum over its query heads."""
    out = {}
    for layer, score in scores.items():
        size = score.numel() // groups
        out[layer] = [float(score[g * size : (g + 1) * size].sum()) for g in range(groups)]
    return out


def choose_groups(scores: dict[int, list[float]], plan: str, fraction: float = 1 / 3) -> dict[int, list[int]]:
    """Key/value groups to remove per layer: the least important in each layer, or the least important
    `fraction` of all groups globally with at least one group left in every layer."""
    if plan == "group_per_layer":
        return {layer: [int(np.argmin(values))] for layer, values in scores.items()}
    groups = len(next(iter(scores.values())))
    budget = round(fraction * groups * len(scores))
    ranked = sorted((value, layer, group) for layer, values in scores.items() for group, value in enumerate(values))
    chosen: dict[int, list[int]] = {}
    for _, layer, group in ranked:
        if sum(len(g) for g in chosen.values()) >= budget:
            break
        if len(chosen.get(layer, [])) < groups - 1:
            chosen.setdefault(layer, []).append(group)
    return {layer: sorted(groups_) for layer, groups_ in sorted(chosen.items())}


def recover(model, batches: list[dict], lr: float, seed: int) -> dict:
    """Fine-tune `model` in place as a causal LM on `batches` (AdamW at a constant rate, all weights, gradient norm
    clipped at 1) through the training app's loop (`attnreg.app.train.fit_causal_lm`); returns the loss log."""
    log = fit_causal_lm(model, DataLoader(batches, batch_size=None), steps=len(batches), lr=lr, clip=1.0, seed=seed)
    return {"losses": log["train/loss"], "seconds": log["seconds"]}


@torch.no_grad()
def generation_speed(models: dict, prompts: dict[int, torch.Tensor], new_tokens: int, repetitions: int) -> dict:
    """Tokens generated per second (greedy, KV cache) per model and batch size: repetitions interleaved across the
    models, the median kept; one untimed warm-up each."""
    times: dict[str, dict[int, list[float]]] = {name: {size: [] for size in prompts} for name in models}
    for repetition in range(repetitions + 1):
        for size, input_ids in prompts.items():
            for name, model in models.items():
                started = time.perf_counter()
                model.generate(
                    input_ids=input_ids,
                    attention_mask=torch.ones_like(input_ids),
                    max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens,
                    do_sample=False,
                    use_cache=True,
                    pad_token_id=0,
                )
                if repetition > 0:
                    times[name][size].append(time.perf_counter() - started)
    out = {}
    for name in models:
        out[name] = {}
        for size in prompts:
            median = statistics.median(times[name][size])
            out[name][str(size)] = {
                "tokens_per_s": round(size * new_tokens / median, 2),
                "median_s": round(median, 4),
                "times_s": [round(t, 4) for t in times[name][size]],
            }
    reference = next(iter(models))
    for name in models:
        for size in prompts:
            entry = out[name][str(size)]
            entry["ratio"] = round(entry["tokens_per_s"] / out[reference][str(size)]["tokens_per_s"], 3)
    return out


@torch.no_grad()
def greedy(model, tokenizer, prompts: list[str], new_tokens: int) -> list[str]:
    out = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        tokens = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
        out.append(tokenizer.decode(tokens[0, ids.shape[1] :], skip_special_tokens=True))
    return out


def speed_prompts(tokenizer, texts: list[str], length: int) -> dict[int, torch.Tensor]:
    """Batch 1 and 8 of prompts cut to `length` tokens (no padding), from texts at least that long."""
    rows = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= length:
            rows.append(ids[:length])
        if len(rows) == 8:
            break
    while len(rows) < 8:  # short texts (quick): repeat
        rows.append((rows or [[1] * length])[len(rows) % max(len(rows), 1)])
    batch = torch.tensor(rows)
    return {1: batch[:1], 8: batch}


def markdown(report: dict, args) -> str:
    setup, models = report["setup"], report["models"]
    speed = report["speed"]
    lines = [
        f"# Head pruning of a decoder ({setup['model']})",
        "",
        *quick_banner(args.quick),
        f"Importance on {setup['importance_sentences']} EWT training sentences; key/value groups removed physically; "
        f"recovery: {args.recovery} steps of {args.batch} EWT training sentences (AdamW lr {args.lr:g}, all weights), "
        f"the same batches for every model, the unpruned one included. Perplexity on {setup['eval_sentences']} EWT "
        f"test sentences. Speed: greedy generation of {args.new_tokens} tokens with the KV cache after a "
        f"{args.prompt_tokens}-token prompt, {args.repetitions} repetitions interleaved, medians, "
        f"{setup['threads']} torch thread(s).",
        "",
    ]
    rows = []
    for name, entry in models.items():
        s1, s8 = speed[name]["1"], speed[name]["8"]
        rows.append(
            [
                name,
                entry["heads"],
                entry["kv_heads"],
                f"{entry['parameters'] / 1e6:.1f}M",
                f"{entry['perplexity_before']:.2f}",
                f"{entry['perplexity_after']:.2f}",
                f"{entry['perplexity_after'] / models['unpruned']['perplexity_after']:.3f}",
                f"{s1['tokens_per_s']:.1f} ({s1['ratio']:.2f}x)",
                f"{s8['tokens_per_s']:.1f} ({s8['ratio']:.2f}x)",
            ]
        )
    lines += table(
        [
            "model",
            "query heads",
            "kv heads",
            "parameters",
            "perplexity, no recovery",
            "after recovery",
            "ratio to unpruned (both recovered)",
            "tokens/s batch 1",
            "tokens/s batch 8",
        ],
        rows,
    )
    lines += [
        "",
        "Speeds are of the recovered models (recovery does not change shapes); ratios to the unpruned model.",
        "",
    ]
    for name, entry in models.items():
        if entry["removed_groups"]:
            layers = ", ".join(f"L{layer}: {groups}" for layer, groups in entry["removed_groups"].items())
            lines += [f"Groups removed, {name}: {layers}", ""]
    lines += ["## Greedy generations (after recovery; the unpruned base model without it)", ""]
    for index, prompt in enumerate(PROMPTS):
        lines += [f"**{prompt}**", ""]
        for name, texts in report["generations"].items():
            lines.append(f"- {name}: {texts[index]!r}")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plans", nargs="+", default=["group_per_layer", "global_third"])
    parser.add_argument("--importance", type=int, default=64, help="EWT training sentences for head importance")
    parser.add_argument("--recovery", type=int, default=40, help="recovery steps")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--eval", type=int, default=500, help="EWT test sentences for perplexity")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    add_output_arguments(parser, "tiny random Llama, 2 recovery steps, 1 repetition")
    args = parser.parse_args()
    args.out = output_dir(args, "decoder_pruning")
    if args.quick:
        args.recovery, args.repetitions, args.importance, args.new_tokens, args.prompt_tokens = 2, 1, 16, 4, 4
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    if args.quick:
        if has_ewt():
            pool, test = read_ewt("train", 64, min_words=5), read_ewt("test", 16, min_words=3)
        else:
            pool, test = builtin_sentences(64, seed=10), builtin_sentences(16, seed=12)
        tokenizer = quick_tokenizer([s.text for s in pool + test] + PROMPTS)
        base = quick_model(tokenizer, layers=2, heads=6, hidden=48)  # 3 key/value groups of 2, as SmolLM2's 3 of 3
        description = "tiny random Llama"
    else:
        base, tokenizer = load_smollm2()
        pool, test = read_ewt("train", min_words=5), read_ewt("test", args.eval, min_words=2)
        description = "SmolLM2-135M-Instruct, float32"
    config = base.config
    heads, groups = config.num_attention_heads, config.num_key_value_heads
    per_group = heads // groups
    order = np.random.default_rng(args.seed).permutation(len(pool))
    texts = [pool[i].text for i in order]
    importance_texts = texts[: args.importance]
    recovery_texts = [texts[(args.importance + i) % len(texts)] for i in range(args.recovery * args.batch)]
    test_texts = [s.text for s in test]

    print(f"{description}: head importance on {len(importance_texts)} sentences", flush=True)
    clock = time.perf_counter()
    scores = head_importance(base, lm_batches(tokenizer, importance_texts, args.batch, args.max_length))
    importance_seconds = time.perf_counter() - clock
    by_group = group_scores(scores, groups)

    recovery_batches = lm_batches(tokenizer, recovery_texts, args.batch, args.max_length)
    models: dict = {}
    entries: dict = {}
    for name in ["unpruned", *args.plans]:
        model = copy.deepcopy(base).eval()
        removed = {} if name == "unpruned" else choose_groups(by_group, name)
        if removed:
            spec = {layer: [g * per_group + i for g in gs for i in range(per_group)] for layer, gs in removed.items()}
            prune_heads(model, spec)
        before = perplexity(model, tokenizer, test_texts, 32, args.max_length)["perplexity"]
        log = recover(model, recovery_batches, args.lr, args.seed)
        after = perplexity(model, tokenizer, test_texts, 32, args.max_length)["perplexity"]
        attention = [model.model.layers[i].self_attn for i in range(config.num_hidden_layers)]
        entries[name] = {
            "removed_groups": {str(layer): gs for layer, gs in removed.items()},
            "pruned_heads": {str(layer): list(h) for layer, h in pruned_heads(model).items()},
            "heads": sum(a.q_proj.out_features // config.head_dim for a in attention),
            "kv_heads": sum(a.k_proj.out_features // config.head_dim for a in attention),
            "parameters": count_parameters(model),
            "perplexity_before": before,
            "perplexity_after": after,
            "recovery": log,
        }
        models[name] = model
        print(f"  {name}: perplexity {before:.2f} -> {after:.2f} after recovery ({log['seconds']:.0f} s)", flush=True)

    print("generation speed", flush=True)
    prompts = speed_prompts(tokenizer, test_texts, args.prompt_tokens)
    speed = generation_speed(models, prompts, args.new_tokens, args.repetitions)
    generations = {"unpruned base (no recovery)": greedy(base, tokenizer, PROMPTS, 24)}
    generations.update({name: greedy(model, tokenizer, PROMPTS, 24) for name, model in models.items()})
    report = {
        "setup": {
            "model": description,
            "heads": heads,
            "kv_heads": groups,
            "layers": config.num_hidden_layers,
            "importance_sentences": len(importance_texts),
            "importance_seconds": round(importance_seconds, 1),
            "eval_sentences": len(test_texts),
            "threads": torch.get_num_threads(),
            "quick": args.quick,
        },
        "importance": {str(layer): [round(float(v), 4) for v in score] for layer, score in scores.items()},
        "group_importance": {str(layer): [round(v, 4) for v in values] for layer, values in by_group.items()},
        "models": entries,
        "base_perplexity": entries["unpruned"]["perplexity_before"],
        "speed": speed,
        "generations": generations,
        "seconds": round(time.perf_counter() - started, 1),
    }
    text = markdown(report, args)
    write_results(args.out, report, text, args)
    print(text)


if __name__ == "__main__":
    main()
