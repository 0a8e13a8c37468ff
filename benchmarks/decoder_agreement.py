"""Priors a decoder can use (issue 39): does a verb -> subject (`nsubj`) prior move subject-verb agreement on
SmolLM2-135M? Paired seeds: LM-only fine-tuning against the nsubj prior on one head, on a few heads, and on one head
together with the parent prior on another, all on the same batches of EWT training sentences.

Per seed, every arm starts from the pretrained model and sees the same batches (AdamW, constant learning rate). The LM
arm minimises the next-token loss; each prior arm adds `--weight` times `SyntaxPriorKL(kinds=...)`: each supervised
head's rows pulled toward its kind (`nsubj`: a verb's row onto its subject, which precedes it; `parent`: a word's row
onto its parent where that lies to its left), blockwise, causal. Kinds are checked against the training sentences
first (`attnreg.syntax.check_priors`) and their counts reported.

Evaluated for the base model and every trained one:
- agreement minimal pairs built from EWT dev and test trees (`attnreg.syntax.agreement`: is/are, was/were, has/have,
  does/do and regular -s verbs, noun subjects before the verb), without and with attractors, scored by the
  log-probability of each verb form given the prefix (`attnreg.analysis.agreement`), beside the closest-noun and
  always-singular baselines;
- perplexity of EWT test sentences, each alone;
- each supervised head's accuracy on its kind: the share of rows (tokens of words with a target at or before them)
  whose most attended key token (the query token itself left out) is a target word's first token.
Per prior arm, paired differences against the LM arm over seeds (mean ± sd, paired t-test, seeds improved).

    python benchmarks/decoder_agreement.py                   # 5 seeds x 4 arms, 300 steps of 8 (a GPU run)
    python benchmarks/decoder_agreement.py --quick           # tiny random Llama, a few sentences, to a temp folder
    python benchmarks/decoder_agreement.py --pairs-only --run pairs   # no model: pairs, baselines, kind counts
"""

from __future__ import annotations

import argparse
import copy
import time
import warnings

import numpy as np
import torch
from common import add_output_arguments, output_dir, quick_banner, table, write_results
from decoder_common import has_ewt, load_smollm2, mean_sd, perplexity, pm, quick_model, quick_tokenizer, read_ewt

import attnreg
from attnreg.analysis.agreement import agreement_scores
from attnreg.losses import causal_prior
from attnreg.methods import SyntaxPriorKL
from attnreg.syntax import SyntaxCollator, check_priors, describe_counts
from attnreg.syntax.agreement import minimal_pairs

SPLITS = ("without_attractors", "with_attractors", "all")


def heads(text: str) -> dict[int, list[int]]:
    """'15:2 18:5' -> {15: [2], 18: [5]}."""
    out: dict[int, list[int]] = {}
    for item in text.split():
        layer, head = item.split(":")
        out.setdefault(int(layer), []).append(int(head))
    return out


def arms(args) -> dict[str, dict[str, dict[int, list[int]]] | None]:
    """Arm name -> `SyntaxPriorKL` kinds (None: LM only)."""
    return {
        "lm": None,
        "nsubj_1": {"nsubj": heads(args.one)},
        "nsubj_few": {"nsubj": heads(args.few)},
        "nsubj_parent": {"nsubj": heads(args.one), "parent": heads(args.parent)},
    }


# --- training --------------------------------------------------------------------------------------------------


def train(base, tokenizer, sentences, args, seed: int, kinds) -> tuple[torch.nn.Module, dict]:
    """A copy of `base` fine-tuned on `sentences` (this seed's order) as a causal LM, plus the kinds' KL."""
    torch.manual_seed(seed)
    model = copy.deepcopy(base).train()
    kl = None
    if kinds is not None:
        kl = SyntaxPriorKL(weight=args.weight, kinds=kinds)
        kl.bind(model)
        kl.start(args.steps)
    collate = SyntaxCollator(
        tokenizer,
        prior=None,
        kinds=kl.kind_priors if kl else {},
        causal=True,
        lm_labels=True,
        max_length=args.max_length,
    )
    hub = attnreg.attach(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    log: dict = {"lm_loss": [], "kl": []}
    started = time.perf_counter()
    for step in range(args.steps):
        batch = collate(sentences[step * args.batch : (step + 1) * args.batch])
        device = next(model.parameters()).device
        batch = {key: value.to(device) for key, value in batch.items()}
        inputs = {key: value for key, value in batch.items() if not key.startswith("attnreg_prior")}
        if kl is not None:
            with hub.capture(kl.layers, inputs=True) as record:
                output = model(**inputs)
            value, _ = kl.term(record, batch, step)
            loss = output.loss + value
        else:
            output, value = model(**inputs), None
            loss = output.loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        log["lm_loss"].append(round(output.loss.item(), 4))
        log["kl"].append(None if value is None else round(value.item() / args.weight, 4))
        if step % 25 == 0 or step == args.steps - 1:
            shown = "" if value is None else f" kl {value.item() / args.weight:.3f}"
            print(f"  seed {seed} step {step + 1}/{args.steps}: lm {output.loss.item():.3f}{shown}", flush=True)
    log["seconds"] = round(time.perf_counter() - started, 1)
    if kl is not None:
        kl.unbind()
    optimizer.zero_grad(set_to_none=True)
    return model.eval(), log


# --- evaluation ----------------------------------------------------------------------------------------------


@torch.no_grad()
def kind_accuracy(model, tokenizer, sentences, kinds, args) -> dict[str, float]:
    """'<spec> L<l>H<h>' -> share of rows (tokens of words with a target at or before them) whose most attended key
    token (the query token itself left out) is a target (a target word's first token)."""
    kl = SyntaxPriorKL(kinds=kinds)
    kl.bind(model)
    collate = SyntaxCollator(tokenizer, prior=None, kinds=kl.kind_priors, causal=True, max_length=args.max_length)
    hub = attnreg.attach(model)
    device = next(model.parameters()).device
    hits: dict[str, list[int]] = {}
    for start in range(0, len(sentences), args.eval_batch):
        chunk = sentences[start : start + args.eval_batch]
        with warnings.catch_warnings():  # the rows a decoder cannot reach: counted before training
            warnings.simplefilter("ignore")
            batch = collate(chunk)
        inputs = {k: v.to(device) for k, v in batch.items() if not k.startswith("attnreg_prior")}
        with hub.capture(kl.layers) as record:
            model(**inputs)
        for spec, child in kl._kinds.items():
            raw = batch[child.prior_key]  # key indices [B, T] (parent) or rows [B, T, T]
            if raw.dim() == 2:
                raw = torch.nn.functional.one_hot(raw.clamp_min(0), raw.shape[1]) * (raw >= 0)[..., None]
            prior = causal_prior(raw.float())  # [B, T, T]: targets at or before the query
            rows = prior.sum(-1) > 0
            position = torch.arange(prior.shape[1])
            for layer, chosen in child.heads.items():
                probs = record[layer].float().cpu()  # [B, H, T, T]
                for head in chosen:
                    p = probs[:, head].clone()
                    p[:, position, position] = 0  # the query token itself
                    top = p.argmax(-1)  # the most attended key token (targets are first pieces)
                    hit = prior.gather(-1, top[..., None]).squeeze(-1) > 0
                    counts = hits.setdefault(f"{spec} L{layer}H{head}", [0, 0])
                    counts[0] += int((hit & rows).sum())
                    counts[1] += int(rows.sum())
    kl.unbind()
    return {name: round(100 * right / max(total, 1), 2) for name, (right, total) in hits.items()}


def evaluate(model, tokenizer, data, args, kinds) -> dict:
    started = time.perf_counter()
    out = {
        split: {
            key: value for key, value in agreement_scores(model, tokenizer, pairs, args.eval_batch).items()
            if key != "margins"
        }
        for split, pairs in data["pairs"].items()
    }  # fmt: skip
    out["perplexity"] = perplexity(model, tokenizer, [s.text for s in data["eval"]["test"]], args.eval_batch)
    out["kind_accuracy"] = kind_accuracy(model, tokenizer, data["eval"]["test"], kinds, args) if kinds else {}
    out["seconds"] = round(time.perf_counter() - started, 1)
    return out


# --- summary ---------------------------------------------------------------------------------------------------


def paired_test(differences: list[float]) -> dict:
    """Mean ± sd of per-seed differences, a two-sided paired t-test (p; None below 2 seeds) and seeds above 0."""
    from scipy import stats

    out = mean_sd(differences)
    spread = np.std(differences, ddof=1) if len(differences) > 1 else 0.0
    out["p"] = float(stats.ttest_1samp(differences, 0.0).pvalue) if len(differences) > 1 and spread > 0 else None
    out["seeds_up"] = sum(d > 0 for d in differences)
    return out


def summarize(report: dict, args) -> dict:
    runs = report["runs"]
    seeds = [str(seed) for seed in args.seeds]
    names = list(runs[seeds[0]])
    summary: dict = {}
    for arm in names:
        entry: dict = {}
        for split in report["setup"]["pairs"]:
            for part in SPLITS:
                values = [runs[s][arm]["eval"][split]["accuracy"][part] for s in seeds]
                if None not in values:
                    entry[f"{split}_{part}"] = mean_sd([100 * v for v in values])
                    if arm != "lm":
                        lm = [runs[s]["lm"]["eval"][split]["accuracy"][part] for s in seeds]
                        entry[f"{split}_{part}_paired"] = paired_test(
                            [100 * (a - b) for a, b in zip(values, lm, strict=True)]
                        )
        entry["perplexity"] = mean_sd([runs[s][arm]["eval"]["perplexity"]["perplexity"] for s in seeds])
        if arm != "lm":
            ratios = [
                runs[s][arm]["eval"]["perplexity"]["perplexity"] / runs[s]["lm"]["eval"]["perplexity"]["perplexity"]
                for s in seeds
            ]
            entry["perplexity_ratio"] = mean_sd(ratios)
            heads_ = runs[seeds[0]][arm]["eval"]["kind_accuracy"]
            entry["kind_accuracy"] = {
                name: mean_sd([runs[s][arm]["eval"]["kind_accuracy"][name] for s in seeds]) for name in heads_
            }
        summary[arm] = entry
    return summary


def markdown(report: dict, args) -> str:
    base, summary, setup = report["base"], report["summary"], report["setup"]
    lines = [
        f"# Priors a decoder can use: nsubj prior and agreement ({setup['model']})",
        "",
        *quick_banner(args.quick),
        f"Fine-tuned as a causal LM on EWT training sentences ({args.steps} steps of {args.batch}, AdamW lr "
        f"{args.lr:g}, prior weight {args.weight:g}, max {args.max_length} tokens), seeds {args.seeds} paired (same "
        f"batches in every arm). Arms: {', '.join(f'{name} = {kinds}' for name, kinds in setup['arms'].items())}.",
        "",
        "Prior kinds on the training sentences:",
        "",
        *[f"- {line}" for line in setup["kind_counts"].splitlines()],
        "",
        "## Agreement minimal pairs (accuracy %, mean ± sd over seeds)",
        "",
    ]
    for split, count in setup["pairs"].items():
        lines.append(
            f"EWT {split}: {count['without_attractors']} pairs without attractors, {count['with_attractors']} with. "
            f"Baselines: closest noun {100 * base[split]['baselines']['closest_noun']['without_attractors']:.1f} / "
            f"{100 * base[split]['baselines']['closest_noun']['with_attractors']:.1f}, always singular "
            f"{100 * base[split]['baselines']['always_singular']['without_attractors']:.1f} / "
            f"{100 * base[split]['baselines']['always_singular']['with_attractors']:.1f} (without / with attractors)."
        )
    lines.append("")
    rows = []
    for split in setup["pairs"]:
        rows.append(
            [
                f"base ({split})",
                *[f"{100 * base[split]['accuracy'][part]:.1f}" if base[split]["accuracy"][part] is not None else ""
                  for part in SPLITS],
                "",
            ]
        )  # fmt: skip
        for arm, entry in summary.items():
            row = [f"{arm} ({split})"]
            for part in SPLITS:
                row.append(pm(entry[f"{split}_{part}"]) if f"{split}_{part}" in entry else "")
            paired = entry.get(f"{split}_with_attractors_paired")
            row.append(
                ""
                if paired is None
                else f"{pm(paired)} (p {paired['p']:.2g}, {paired['seeds_up']}/{len(args.seeds)} up)"
                if paired["p"] is not None
                else f"{pm(paired)} ({paired['seeds_up']}/{len(args.seeds)} up)"
            )
            rows.append(row)
    lines += table(["model", "without attractors", "with attractors", "all", "with attractors - LM (paired)"], rows)
    lines += ["", "## Perplexity (EWT test) and the supervised heads on their kind (EWT test, % of rows)", ""]
    rows = [["base", f"{base['perplexity']['perplexity']:.2f}", "", ""]]
    for arm, entry in summary.items():
        ratio = f"{pm(entry['perplexity_ratio'], 100, 2)}%" if "perplexity_ratio" in entry else ""
        heads_ = "; ".join(
            f"{name} {pm(value)} (base {base['kind_accuracy'].get(name, float('nan')):.1f})"
            for name, value in entry.get("kind_accuracy", {}).items()
        )
        rows.append([arm, pm(entry["perplexity"], digits=2), ratio, heads_])
    lines += table(["model", "perplexity", "perplexity / LM", "supervised heads: accuracy on their kind"], rows)
    lines += [
        "",
        "Training time per run (s, median): "
        + "; ".join(
            f"{arm} {np.median([report['runs'][str(s)][arm]['train']['seconds'] for s in args.seeds]):.0f}"
            for arm in summary
        ),
        "",
    ]
    return "\n".join(lines)


# --- main ------------------------------------------------------------------------------------------------------


def load(args) -> tuple:
    """(model, tokenizer, training sentences, evaluation sentences by split, description)."""
    if args.quick:
        if not has_ewt():
            raise SystemExit("decoder_agreement needs UD English EWT under ../shared/data (agreement pairs)")
        train_sentences = read_ewt("train", 64, min_words=5)
        evaluation = {"dev": read_ewt("dev", 60, min_words=3), "test": read_ewt("test", 60, min_words=3)}
        pairs = [p for split in evaluation.values() for p in minimal_pairs(split)]
        texts = [s.text for s in train_sentences] + [s.text for split in evaluation.values() for s in split]
        tokenizer = quick_tokenizer(texts + [p.bad for p in pairs])
        return quick_model(tokenizer), tokenizer, train_sentences, evaluation, "tiny random Llama (EWT)"
    model, tokenizer = load_smollm2()
    if torch.cuda.is_available():
        model = model.cuda()
    train_sentences = read_ewt("train", min_words=args.min_words)
    evaluation = {split: read_ewt(split) for split in ("dev", "test")}
    return model, tokenizer, train_sentences, evaluation, "SmolLM2-135M-Instruct, float32"


def pairs_only(args) -> None:
    """No model: the minimal pairs of EWT dev and test (counts, baselines) and the kinds' rows on EWT train."""
    from attnreg.syntax.agreement import baselines
    from attnreg.syntax.agreement import counts as pair_counts

    train_sentences = read_ewt("train", min_words=args.min_words)
    kinds = SyntaxPriorKL(kinds={spec: [0] for spec in ("nsubj", "det", "amod", "obj", "parent")}).kind_priors
    kind_counts = describe_counts(check_priors(train_sentences, kinds, causal=True), causal=True)
    report: dict = {"setup": {"quick": False, "train_sentences": len(train_sentences)}, "kind_counts": kind_counts}
    lines = ["# Agreement minimal pairs from EWT (no model)", "", "Kinds on EWT train (causal):", ""]
    lines += [f"- {line}" for line in kind_counts.splitlines()] + [""]
    rows = []
    for split in ("dev", "test"):
        pairs = minimal_pairs(read_ewt(split))
        report[split] = {"counts": pair_counts(pairs), "baselines": baselines(pairs)}
        for name, scores in report[split]["baselines"].items():
            rows.append([split, name, *[f"{100 * scores[part]:.1f}" for part in SPLITS]])
        rows.append([split, "pairs", *[report[split]["counts"][part] for part in SPLITS]])
    lines += table(["split", "baseline", "without attractors", "with attractors", "all"], rows)
    write_results(args.out, report, "\n".join(lines), args)
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--weight", type=float, default=1.0)
    parser.add_argument("--one", default="15:2", help="the nsubj head of the one-head arm, LAYER:HEAD")
    parser.add_argument("--few", default="15:2 15:5 18:2 18:5", help="the nsubj heads of the few-heads arm")
    parser.add_argument("--parent", default="15:3", help="the parent-prior head(s) of the nsubj_parent arm")
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--min-words", type=int, default=5, help="training sentences with at least this many words")
    parser.add_argument("--eval-batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--pairs-only", action="store_true", help="no model: pair counts, baselines, kind counts")
    add_output_arguments(parser, "tiny random Llama, 64 EWT training sentences, 2 steps, 1 seed")
    args = parser.parse_args()
    args.out = output_dir(args, "decoder_agreement")
    if args.pairs_only:
        return pairs_only(args)
    if args.quick:
        args.seeds, args.steps, args.one, args.few, args.parent = args.seeds[:1], 2, "1:0", "1:0 1:2", "1:1"
        args.eval_batch = 16
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    model, tokenizer, train_sentences, evaluation, description = load(args)
    chosen_arms = arms(args)
    all_kinds = {spec: None for kinds in chosen_arms.values() if kinds for spec in kinds}
    probe = SyntaxPriorKL(kinds={spec: [0] for spec in all_kinds})
    counts = check_priors(train_sentences, probe.kind_priors, causal=True)
    print(describe_counts(counts, causal=True), flush=True)
    data = {"eval": evaluation, "pairs": {split: minimal_pairs(sentences) for split, sentences in evaluation.items()}}
    every_head = {spec: {} for spec in all_kinds}
    for kinds in chosen_arms.values():
        for spec, chosen in (kinds or {}).items():
            for layer, heads_ in chosen.items():
                every_head[spec][layer] = sorted({*every_head[spec].get(layer, []), *heads_})
    print(f"{description}: {len(train_sentences)} training sentences; evaluating the base model", flush=True)
    base = evaluate(model, tokenizer, data, args, every_head)
    runs: dict = {}
    for seed in args.seeds:
        order = np.random.default_rng(seed).permutation(len(train_sentences))
        chosen = [train_sentences[i] for i in np.resize(order, args.steps * args.batch)]
        runs[str(seed)] = {}
        for arm, kinds in chosen_arms.items():
            trained, log = train(model, tokenizer, chosen, args, seed, kinds)
            result = evaluate(trained, tokenizer, data, args, kinds)
            runs[str(seed)][arm] = {"train": log, "eval": result}
            shown = ", ".join(
                f"{split} {100 * result[split]['accuracy']['with_attractors']:.1f}"
                for split in data["pairs"]
                if result[split]["accuracy"]["with_attractors"] is not None
            )
            print(
                f"  seed {seed} {arm}: with attractors {shown}; perplexity {result['perplexity']['perplexity']:.2f}; "
                f"{result['kind_accuracy']} (train {log['seconds']:.0f} s, eval {result['seconds']:.0f} s)",
                flush=True,
            )
            del trained
    report = {
        "setup": {
            "model": description,
            "arms": {name: kinds for name, kinds in chosen_arms.items()},
            "kind_counts": describe_counts(counts, causal=True),
            "train_sentences_pool": len(train_sentences),
            "pairs": {split: base[split]["counts"] for split in data["pairs"]},
            "quick": args.quick,
        },
        "base": base,
        "runs": runs,
        "seconds": round(time.perf_counter() - started, 1),
    }
    report["summary"] = summarize(report, args)
    text = markdown(report, args)
    write_results(args.out, report, text, args)
    print(text)


if __name__ == "__main__":
    main()
