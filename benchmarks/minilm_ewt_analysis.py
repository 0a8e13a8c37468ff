"""Attention analysis of the pretrained MiniLM on UD English EWT dev, beside Clark et al. 2019's BERT-base.

Two parts, one run:

1. Speed (variants interleaved, order rotated every repeat, medians of per-repeat ratios), on the first
   `--speed-sentences` dev sentences:
   - `loop`: the previous `parent_accuracy` (kept here as the baseline): batches in file order, then a
     Python loop per sentence and per relation over `word_attention`;
   - `parent_accuracy`: the batched pass (length-sorted batches, one vectorized scoring per layer,
     both directions);
   - `analyze`: everything at once (per-head statistics, output norms, both syntax directions, token
     similarity);
   - `forward`: the model alone (SDPA) over the same length-sorted batches: the floor.
2. The full analysis of all EWT dev sentences (2,001), timed once, written as a report
   (`attnreg.app.analyze.write_report`) into `benchmarks/results/minilm_ewt_analysis/<--run>/` (default
   `default`, or `--out DIR`), with `results.md` and `results.json` there: the best head per relation in
   both directions against the best fixed-offset baseline, the best single head against right-branching,
   Clark et al.'s figures beside them, and a 512-token heatmap grid of all 72 heads.

    python benchmarks/minilm_ewt_analysis.py            # full (about 5 minutes on 2 busy cores)
    python benchmarks/minilm_ewt_analysis.py --quick    # smoke run: tiny random BERT, 64 sentences, to a temp folder
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from common import add_output_arguments, data_path, output_dir, quick_banner, write_results
from PIL import Image
from transformers import AutoModel, AutoTokenizer

import attnreg
from attnreg.analysis import ParentAccuracy, analyze, parent_accuracy, word_attention
from attnreg.analysis.plots import attention_grid
from attnreg.app.analyze import write_report
from attnreg.app.models import minilm_directory
from attnreg.syntax import Sentence, align_offsets, read_conllu
from attnreg.tiny import tiny_model

# Clark et al. 2019, "What Does BERT Look At?", BERT-base on the WSJ (Stanford dependencies): best head
# per relation, and the best single head over all words against the right-branching baseline.
CLARK = {"det": 94.3, "obj": 86.8, "nsubj": 58.5, "all": 34.5}
CLARK_RIGHT_BRANCHING = 26.3
RELATIONS = ["nsubj", "obj", "det", "amod", "case", "aux", "advmod", "nmod:poss", "mark", "compound", "cc", "cop"]
RELATIONS += ["conj", "obl", "nmod", "punct", "xcomp", "ccomp", "advcl", "nummod", "aux:pass", "nsubj:pass"]


@torch.no_grad()
def loop_parent_accuracy(model, tokenizer, sentences, batch_size: int = 32, max_offset: int = 5) -> ParentAccuracy:
    """The previous implementation (file-order batches, a Python loop per sentence and relation)."""
    hub = attnreg.attach(model)
    result = ParentAccuracy.empty(hub.num_layers, hub.layers[0].num_heads, max_offset)
    for start in range(0, len(sentences), batch_size):
        chunk = sentences[start : start + batch_size]
        encoding = tokenizer(
            [s.text for s in chunk], padding=True, truncation=True, max_length=128, return_offsets_mapping=True
        )
        offsets = np.asarray(encoding.pop("offset_mapping"))
        inputs = {key: torch.tensor(value) for key, value in encoding.items()}
        with hub.capture() as probs:
            model(**inputs)
        stacked = torch.stack([probs[layer] for layer in range(hub.num_layers)], 1).float()
        for row, sentence in enumerate(chunk):
            alignment = align_offsets(sentence, offsets[row])
            heads = np.asarray(sentence.heads)
            kept = alignment.pieces > 0
            scored = (heads > 0) & kept & kept[np.maximum(heads - 1, 0)]
            if not scored.any():
                continue
            words = np.flatnonzero(scored)
            gold = torch.as_tensor(heads[words] - 1)
            matrix = word_attention(stacked[row], alignment)
            matrix = matrix.masked_fill(torch.eye(matrix.shape[-1], dtype=torch.bool), -1.0)
            correct = matrix[..., words, :].argmax(-1) == gold
            result.hits += correct.sum(-1)
            result.words += len(words)
            relations = np.asarray(sentence.relations)[words]
            for relation in np.unique(relations):
                chosen = torch.as_tensor(relations == relation)
                hits, count = result.by_relation.get(relation, (torch.zeros_like(result.hits), 0))
                result.by_relation[relation] = (hits + correct[..., chosen].sum(-1), count + int(chosen.sum()))
    result.present[:] = True
    return result


@torch.no_grad()
def forward_only(model, tokenizer, sentences, batch_size: int = 32) -> None:
    ordered = sorted(sentences, key=lambda s: len(tokenizer(s.text)["input_ids"]))
    for start in range(0, len(ordered), batch_size):
        texts = [s.text for s in ordered[start : start + batch_size]]
        model(**tokenizer(texts, padding=True, truncation=True, max_length=128, return_tensors="pt"))


def speed(model, sdpa_model, tokenizer, sentences: list[Sentence], repeats: int) -> dict:
    variants: dict[str, Callable[[], object]] = {
        "loop": lambda: loop_parent_accuracy(model, tokenizer, sentences),
        "parent_accuracy": lambda: parent_accuracy(model, tokenizer, sentences),
        "analyze": lambda: analyze(model, tokenizer, sentences),
        "forward": lambda: forward_only(sdpa_model, tokenizer, sentences),
    }
    names = list(variants)
    times: dict[str, list[float]] = {name: [] for name in names}
    for repeat in range(repeats):
        for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
            started = time.perf_counter()
            variants[name]()
            times[name].append(time.perf_counter() - started)

    def ratio(name: str, baseline: str) -> float:
        return round(statistics.median(t / b for t, b in zip(times[name], times[baseline], strict=True)), 3)

    return {
        "sentences": len(sentences),
        "repeats": repeats,
        "seconds_median": {name: round(statistics.median(values), 2) for name, values in times.items()},
        "parent_accuracy_vs_loop": ratio("parent_accuracy", "loop"),
        "analyze_vs_loop": ratio("analyze", "loop"),
        "analyze_vs_forward": ratio("analyze", "forward"),
        "parent_accuracy_vs_forward": ratio("parent_accuracy", "forward"),
    }


def long_example(tokenizer, sentences: list[Sentence], tokens: int = 510) -> str:
    """Consecutive dev sentences joined while their word pieces fit in `tokens`."""
    texts, total = [], 0
    for sentence in sentences:
        total += len(tokenizer(sentence.text, add_special_tokens=False)["input_ids"])
        if total > tokens:
            break
        texts.append(sentence.text)
    return " ".join(texts)


def relation_rows(result: ParentAccuracy) -> list[dict]:
    table = {row["relation"]: row for row in result.relation_table()}
    rows = []
    for relation in ["all", *RELATIONS]:
        if relation not in table:
            continue
        row = dict(table[relation])
        forward, reverse = row["dependent_to_head_accuracy"], row["head_to_dependent_accuracy"]
        row["best_accuracy"] = max(forward, reverse)
        row["best_direction"] = "dependent_to_head" if forward >= reverse else "head_to_dependent"
        row["clark_bert_base"] = CLARK.get(relation)
        rows.append(row)
    return rows


def markdown(result: dict) -> str:
    full, rows, speed_result = result["full"], result["relations"], result["speed"]
    summary = result["summary"]
    lines = [
        "# Attention analysis of the pretrained MiniLM on UD English EWT dev",
        "",
        *quick_banner(result["quick"]),
        f"{result['model']}, {full['sentences']} sentences, {full['tokens']} tokens, max 128 tokens, "
        f"{result['threads']} torch threads. Word-level attention as in Clark et al. 2019 (to a word: sum over its "
        "pieces; from a word: mean); a word's attention to itself is ignored; root words are not scored. "
        "Heads are `layer-head`, 0-based. Clark et al.'s figures are BERT-base (12 x 12) on the WSJ with "
        "Stanford dependencies (their `dobj` is UD `obj`), so only the shape compares.",
        "",
        "## Best single head against the baselines",
        "",
        "| | MiniLM on EWT dev | Clark et al., BERT-base |",
        "|---|---:|---:|",
        f"| best head, dependent → head | {summary['dependent_to_head']['accuracy']} "
        f"({summary['dependent_to_head']['head']}) | {CLARK['all']} |",
        f"| best head, head → dependent | {summary['head_to_dependent']['accuracy']} "
        f"({summary['head_to_dependent']['head']}) | |",
        f"| right-branching baseline | {summary['right_branching']} | {CLARK_RIGHT_BRANCHING} |",
        f"| best fixed offset | {summary['best_offset']['accuracy']} ({summary['best_offset']['offset']:+d}) | |",
        "",
        "## Best head per relation (parent accuracy, %)",
        "",
        "| relation | words | dependent → head | head → dependent | best offset baseline | gain | Clark BERT-base |",
        "|---|---:|---|---|---|---:|---:|",
    ]
    for row in rows:
        gain = round(row["best_accuracy"] - row["baseline_accuracy"], 1)
        clark = row["clark_bert_base"] if row["clark_bert_base"] is not None else ""
        forward = f"{row['dependent_to_head_head']}: {row['dependent_to_head_accuracy']}"
        reverse = f"{row['head_to_dependent_head']}: {row['head_to_dependent_accuracy']}"
        baseline = f"{row['baseline_accuracy']} ({row['baseline_offset']:+d})"
        cells = [row["relation"], row["words"], forward, reverse, baseline, f"{gain:+.1f}", clark]
        lines.append("| " + " | ".join(str(cell) for cell in cells) + " |")
    seconds = speed_result["seconds_median"]
    lines += [
        "",
        "## Time",
        "",
        f"Whole analysis of EWT dev (statistics, output norms, both syntax directions, token similarity, one pass): "
        f"**{full['seconds']:.1f} s** ({full['tokens_per_second']:.0f} tokens/s), report writing "
        f"{full['report_seconds']:.1f} s. Loading the model and reading the CoNLL-U file are not counted.",
        "",
        f"Speed on the first {speed_result['sentences']} dev sentences, {speed_result['repeats']} repeats interleaved, "
        "medians of per-repeat ratios:",
        "",
        "| variant | median s | ratio |",
        "|---|---:|---|",
        f"| loop (previous parent_accuracy) | {seconds['loop']} | 1 |",
        f"| parent_accuracy (batched, both directions) | {seconds['parent_accuracy']} | "
        f"{speed_result['parent_accuracy_vs_loop']} x loop, {speed_result['parent_accuracy_vs_forward']} x forward |",
        f"| analyze (everything) | {seconds['analyze']} | {speed_result['analyze_vs_loop']} x loop, "
        f"{speed_result['analyze_vs_forward']} x forward |",
        f"| forward (model alone, SDPA, sorted batches) | {seconds['forward']} | |",
        "",
        "## Files",
        "",
        "`summary.md` (roles, per-layer statistics, token importance), `statistics.csv` / `statistics.json` "
        "(every head), `roles.csv`, `relations.csv`, `entropy.png`, `roles.png`, `parent_accuracy.png`, "
        "`attention_example.png` (the first dev sentence), `attention_512.png` (all heads of one input "
        "of about 500 tokens; PNGs saved with 32-colour palettes).",
        "",
    ]
    return "\n".join(lines)


def load_models(quick: bool, tokenizer) -> tuple[torch.nn.Module, torch.nn.Module, str]:
    """(model to analyze, the same on SDPA for the forward floor, description); `quick`: a tiny random BERT."""
    if quick:
        model = tiny_model("bert", vocab=len(tokenizer), hidden=64, layers=2, heads=4, positions=512).eval()
        return model, copy.deepcopy(model), "tiny random BERT (2 layers x 4 heads)"
    directory = minilm_directory()
    model = AutoModel.from_pretrained(directory).eval()
    sdpa_model = AutoModel.from_pretrained(directory, attn_implementation="sdpa").eval()
    return model, sdpa_model, "all-MiniLM-L6-v2 (BERT, 6 layers x 12 heads)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--speed-sentences", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--limit", type=int, help="analyze only the first N dev sentences")
    parser.add_argument("--threads", type=int, default=2)
    add_output_arguments(parser, "a tiny random BERT, 64 sentences, one repeat, one thread")
    args = parser.parse_args()
    if args.quick:
        args.speed_sentences, args.repeats, args.limit, args.threads = 64, 1, 64, 1
    args.out = output_dir(args, "minilm_ewt_analysis")
    torch.set_num_threads(args.threads)
    sentences = read_conllu(data_path("ud_english_ewt", "en_ewt-ud-dev.conllu"))[: args.limit]
    tokenizer = AutoTokenizer.from_pretrained(minilm_directory())
    model, sdpa_model, description = load_models(args.quick, tokenizer)

    speed_result = speed(model, sdpa_model, tokenizer, sentences[: args.speed_sentences], args.repeats)
    print("speed:", json.dumps(speed_result))

    analysis = analyze(model, tokenizer, sentences)
    started = time.perf_counter()
    meta = {"model": description, "data": "UD English EWT dev", "threads": args.threads}
    write_report(analysis, args.out, model, tokenizer, sentences[0], meta, min_relation_words=20)
    report_seconds = time.perf_counter() - started
    hub = attnreg.attach(model)
    encoding = tokenizer(long_example(tokenizer, sentences), return_tensors="pt")
    with torch.no_grad(), hub.capture() as probs:
        model(**encoding)
    length = encoding["input_ids"].shape[1]
    title = f"{description.split(' (')[0]}, all {hub.num_layers * hub.layers[0].num_heads} heads, {length} tokens"
    attention_grid(probs, path=args.out / "attention_512.png", title=title, max_pixels=80, cell_inches=0.9, dpi=90)
    for image in args.out.glob("*.png"):  # 32-colour palettes keep the committed report small
        Image.open(image).convert("RGB").quantize(colors=32, method=Image.Quantize.MEDIANCUT).save(image, optimize=True)

    full = {
        "sentences": analysis.sequences,
        "tokens": analysis.tokens,
        "seconds": round(analysis.seconds, 2),
        "tokens_per_second": round(analysis.tokens / analysis.seconds, 1),
        "report_seconds": round(report_seconds, 2),
    }
    result = {
        "model": description,
        "quick": args.quick,
        "threads": args.threads,
        "full": full,
        "speed": speed_result,
        "summary": analysis.syntax.summary(),
        "clark_bert_base": {"relations": CLARK, "right_branching": CLARK_RIGHT_BRANCHING},
        "relations": relation_rows(analysis.syntax),
        "roles": analysis.roles().counts(),
    }
    write_results(args.out, result, markdown(result), args)
    print(f"full analysis: {full}; results in {args.out}")


if __name__ == "__main__":
    main()
