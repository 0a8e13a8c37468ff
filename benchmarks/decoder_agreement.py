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
Per prior arm, paired differences against the LM arm over seeds (mean ± sd, paired t-test from 2 seeds on, seeds
improved), of the accuracy and of the margin (log p of the right verb form minus the wrong one, a continuous score).
`--eval-sentences N` scores perplexity and the kinds' accuracy on the first N EWT test sentences (default:
all 2,077); the agreement pairs are always all of them (dev 411, test 388).

Resumable, seed by seed: results.json and results.md are written after every finished (seed, arm); a later command
into the same folder (`--run`/`--out`) skips the (seed, arm) runs already there, evaluates the base model only if the
folder has no evaluation of it, and refuses (naming the setting) a folder run with other study settings (steps,
batch, lr, weight, heads, max length, min words, eval sentences). The summary counts the seeds of each cell and gives
the paired test only where 2 or more seeds have both arms; `invocations` records each command and its commit. A
command with nothing left to run rewrites the summary from the folder.

Run so far (benchmarks/results/decoder_agreement/smollm2/, each piece listed in its results.md): seeds 0-4 of the lm,
nsubj_few and nsubj_parent arms. Cost on the 2-core CPU machine with nothing else running, 2 torch threads:
11-14 minutes of training an arm (2.5-2.7 s a step of 8 sentences), 1-2 minutes of evaluation at
`--eval-sentences 500`, the base model once per folder (3 minutes): about 1 hour a seed for the 4 arms, 5 hours for
5 seeds. On shared cores (load 6.5-10, one thread) a step took 7.6-14 s.

    python benchmarks/decoder_agreement.py --seeds 0 --eval-sentences 500 --run smollm2   # one seed, 4 arms
    python benchmarks/decoder_agreement.py --seeds 1 --eval-sentences 500 --run smollm2   # the next, same folder
    python benchmarks/decoder_agreement.py --seeds 2 --arms lm nsubj_few --eval-sentences 500 --run smollm2  # 2 arms
    python benchmarks/decoder_agreement.py --quick           # tiny random Llama, a few sentences, to a temp folder
    python benchmarks/decoder_agreement.py --pairs-only --run pairs   # no model: pairs, baselines, kind counts
"""

from __future__ import annotations

import argparse
import copy
import json
import time
import warnings

import numpy as np
import torch
from common import GIT_AT_START, add_output_arguments, command_line, output_dir, quick_banner, table, write_results
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
    """Agreement pairs of every split (all of them, always); perplexity and the kinds' accuracy on
    `data["eval"]["test"]` (the first `--eval-sentences` of EWT test); the seconds of each part."""
    seconds = {}
    started = time.perf_counter()
    out = {
        split: {
            key: value for key, value in agreement_scores(model, tokenizer, pairs, args.eval_batch).items()
            if key != "margins"
        }
        for split, pairs in data["pairs"].items()
    }  # fmt: skip
    seconds["pairs"] = round(time.perf_counter() - started, 1)
    texts = [s.text for s in data["eval"]["test"]]
    out["perplexity"] = perplexity(model, tokenizer, texts, args.eval_batch)
    seconds["perplexity"] = round(time.perf_counter() - started - seconds["pairs"], 1)
    out["kind_accuracy"] = kind_accuracy(model, tokenizer, data["eval"]["test"], kinds, args) if kinds else {}
    seconds["kind_accuracy"] = round(time.perf_counter() - started - seconds["pairs"] - seconds["perplexity"], 1)
    out["seconds"] = round(time.perf_counter() - started, 1)
    out["seconds_by_part"] = seconds
    return out


# --- summary ---------------------------------------------------------------------------------------------------


def paired_test(differences: list[float]) -> dict:
    """Mean ± sd of per-seed differences, seeds above 0 and, from 2 seeds on, a two-sided paired t-test (`p`; None
    when every difference is the same). One seed: the difference alone (`mean`, `sd` None, no test)."""
    from scipy import stats

    out = mean_sd(differences)
    out["seeds_up"] = sum(d > 0 for d in differences)
    if len(differences) < 2:
        out["sd"], out["p"] = None, None
        return out
    spread = np.std(differences, ddof=1)
    out["p"] = float(stats.ttest_1samp(differences, 0.0).pvalue) if spread > 0 else None
    return out


def seeds_of(runs: dict, arm: str) -> list[str]:
    """The seeds (as the report's keys) that have a finished run of `arm`, in order."""
    return sorted((seed for seed, done in runs.items() if arm in done), key=int)


def summarize(report: dict) -> dict:
    """Per arm with at least one finished seed: its seeds, the mean ± sd over them and, for a prior arm, the paired
    differences against the LM arm over the seeds that have both (a partial grid is summarized as it stands)."""
    runs = report["runs"]
    summary: dict = {}
    for arm in report["setup"]["arms"]:
        seeds = seeds_of(runs, arm)
        if not seeds:
            continue
        paired = [s for s in seeds if arm != "lm" and "lm" in runs[s]]
        entry: dict = {"seeds": [int(s) for s in seeds], "paired_seeds": [int(s) for s in paired]}
        for split in report["setup"]["pairs"]:
            for part in SPLITS:
                values = [runs[s][arm]["eval"][split]["accuracy"][part] for s in seeds]
                if None in values:
                    continue
                entry[f"{split}_{part}"] = mean_sd([100 * v for v in values])
                if paired:
                    lm = [runs[s]["lm"]["eval"][split]["accuracy"][part] for s in paired]
                    ours = [runs[s][arm]["eval"][split]["accuracy"][part] for s in paired]
                    entry[f"{split}_{part}_paired"] = paired_test(
                        [100 * (a - b) for a, b in zip(ours, lm, strict=True)]
                    )
                    lm = [runs[s]["lm"]["eval"][split]["margin"][part] for s in paired]
                    ours = [runs[s][arm]["eval"][split]["margin"][part] for s in paired]
                    entry[f"{split}_{part}_margin_paired"] = paired_test([a - b for a, b in zip(ours, lm, strict=True)])
        entry["perplexity"] = mean_sd([runs[s][arm]["eval"]["perplexity"]["perplexity"] for s in seeds])
        if paired:
            ratios = [
                runs[s][arm]["eval"]["perplexity"]["perplexity"] / runs[s]["lm"]["eval"]["perplexity"]["perplexity"]
                for s in paired
            ]
            entry["perplexity_ratio"] = mean_sd(ratios)
        if arm != "lm":
            names = runs[seeds[0]][arm]["eval"]["kind_accuracy"]
            entry["kind_accuracy"] = {
                name: mean_sd([runs[s][arm]["eval"]["kind_accuracy"][name] for s in seeds]) for name in names
            }
        summary[arm] = entry
    return summary


def shown_paired(paired: dict | None, digits: int = 1) -> str:
    """A paired difference for the table: with its test from 2 seeds on, else the one seed's difference."""
    if paired is None:
        return ""
    count = len(paired["values"])
    if count < 2:
        return f"{paired['mean']:+.{digits}f} (1 seed, no test)"
    test = f"p {paired['p']:.2g}, " if paired["p"] is not None else ""
    return f"{pm(paired, digits=digits)} ({test}{paired['seeds_up']}/{count} up)"


def markdown(report: dict, args) -> str:
    base, summary, setup = report["base"], report["summary"], report["setup"]
    settings = setup["settings"]
    grid = {arm: entry["seeds"] for arm, entry in summary.items()}
    complete = len(grid) == len(setup["arms"]) and all(seeds == grid["lm"] for seeds in grid.values())
    eval_sentences = settings["eval_sentences"]
    perplexity_on = "all of EWT test" if eval_sentences is None else f"the first {eval_sentences} EWT test sentences"
    lines = [
        f"# Priors a decoder can use: nsubj prior and agreement ({setup['model']})",
        "",
        *quick_banner(args.quick),
        f"Fine-tuned as a causal LM on EWT training sentences ({settings['steps']} steps of {settings['batch']}, AdamW "
        f"lr {settings['lr']:g}, prior weight {settings['weight']:g}, max {settings['max_length']} tokens), paired "
        "seeds (same batches in every arm). Arms: "
        + ", ".join(f"{arm} = {kinds}" for arm, kinds in setup["arms"].items())
        + ".",
        "",
        "Seeds finished per arm: " + "; ".join(f"{arm} {seeds}" for arm, seeds in grid.items())
        + ("" if complete else " (a partial grid: paired figures over the seeds that have both arms)")
        + ". Paired tests from 2 seeds on.",
        "",
        "Prior kinds on the training sentences:",
        "",
        *[f"- {line}" for line in setup["kind_counts"].splitlines()],
        "",
        "## Agreement minimal pairs (accuracy %, mean ± sd over seeds)",
        "",
    ]  # fmt: skip
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
                "",
                *[f"{100 * base[split]['accuracy'][part]:.1f}" if base[split]["accuracy"][part] is not None else ""
                  for part in SPLITS],
                "", "", "",
            ]
        )  # fmt: skip
        for arm, entry in summary.items():
            row = [f"{arm} ({split})", len(entry["seeds"])]
            for part in SPLITS:
                row.append(pm(entry[f"{split}_{part}"]) if f"{split}_{part}" in entry else "")
            row.append(shown_paired(entry.get(f"{split}_with_attractors_paired")))
            row += [shown_paired(entry.get(f"{split}_{part}_margin_paired"), 2) for part in SPLITS[:2]]
            rows.append(row)
    header = ["model", "seeds", "without attractors", "with attractors", "all", "with attractors - LM (paired)"]
    header += [f"margin {part.replace('_', ' ')} - LM (paired, nats)" for part in SPLITS[:2]]
    lines += table(header, rows)
    lines += [
        "",
        "The margin is the mean over pairs of log p(right verb form) - log p(wrong one) given the prefix: a "
        "continuous score, which moves before a pair flips.",
    ]
    lines += [
        "",
        f"## Perplexity and the supervised heads on their kind ({perplexity_on}, % of rows)",
        "",
    ]
    rows = [["base", "", f"{base['perplexity']['perplexity']:.2f}", "", ""]]
    for arm, entry in summary.items():
        ratio = f"{pm(entry['perplexity_ratio'], 100, 2)}%" if "perplexity_ratio" in entry else ""
        heads_ = "; ".join(
            f"{name} {pm(value)} (base {base['kind_accuracy'].get(name, float('nan')):.1f})"
            for name, value in entry.get("kind_accuracy", {}).items()
        )
        rows.append([arm, len(entry["seeds"]), pm(entry["perplexity"], digits=2), ratio, heads_])
    lines += table(
        ["model", "seeds", "perplexity", "perplexity / LM", "supervised heads: accuracy on their kind"], rows
    )
    runs = report["runs"]
    lines += [
        "",
        "Seconds per run (median over seeds, training / evaluation): "
        + "; ".join(
            f"{arm} {np.median([runs[s][arm]['train']['seconds'] for s in seeds_of(runs, arm)]):.0f} / "
            f"{np.median([runs[s][arm]['eval']['seconds'] for s in seeds_of(runs, arm)]):.0f}"
            for arm in summary
        )
        + f"; base model evaluation {base['seconds']:.0f}.",
        "",
        "## Pieces (the commands that filled this folder)",
        "",
        *[
            f"- `{piece['command']}` at {str(piece['git']['commit'])[:12]}"
            + (" with uncommitted changes" if piece["git"]["dirty"] else "")
            + f", {piece['date']}: {', '.join(piece['done']) or 'nothing new'}"
            for piece in report["invocations"]
        ],
        "",
    ]
    return "\n".join(lines)


# --- main ------------------------------------------------------------------------------------------------------

# The settings that make a run folder's figures comparable: every (seed, arm) merged into one results.json has them.
STUDY = ("steps", "batch", "lr", "weight", "one", "few", "parent", "max_length", "min_words", "eval_sentences", "quick")


def study_settings(args) -> dict:
    return json.loads(json.dumps({name: getattr(args, name) for name in STUDY}))


def resume(args) -> dict | None:
    """The report already in the run folder (`--out`/`--run`), to add this command's seeds and arms to; None for a
    new folder. Exits naming the setting when the folder was run with other study settings (`STUDY`)."""
    path = args.out / "results.json"
    if not path.is_file():
        return None
    report = json.loads(path.read_text())
    settings = report.get("setup", {}).get("settings")
    if settings is None or "runs" not in report:
        raise SystemExit(
            f"{path} holds no resumable study (no recorded settings); write this run to another folder (--run, --out)"
        )
    for name, value in study_settings(args).items():
        if settings.get(name) != value:
            raise SystemExit(
                f"{path} was run with {name}={settings.get(name)!r}, this command has {name}={value!r}: give the "
                f"same settings to add seeds to that run (--{name.replace('_', '-')}), or another folder (--run, --out)"
            )
    return report


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


def invocation(args, done: list[str]) -> dict:
    """What this command added to the run folder, and the code that made it."""
    git = {key: GIT_AT_START.get(key) for key in ("commit", "dirty")}
    return {"command": command_line(), "git": git, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "done": done}


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
    parser.add_argument(
        "--eval-sentences",
        type=int,
        default=None,
        help="perplexity and the kinds' accuracy on the first N EWT test sentences (default: all 2,077); the "
        "agreement pairs are always all of them",
    )
    parser.add_argument("--eval-batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument(
        "--arms", nargs="+", default=None, help="run only these arms (default: all; the others can follow later)"
    )
    parser.add_argument("--pairs-only", action="store_true", help="no model: pair counts, baselines, kind counts")
    add_output_arguments(parser, "tiny random Llama, 64 EWT training sentences, 2 steps, 1 seed")
    args = parser.parse_args()
    if args.eval_sentences is not None and args.eval_sentences < 1:
        parser.error(f"--eval-sentences must be at least 1, got {args.eval_sentences}")
    args.out = output_dir(args, "decoder_agreement")
    if args.pairs_only:
        return pairs_only(args)
    if args.quick:
        args.seeds, args.steps, args.one, args.few, args.parent = args.seeds[:1], 2, "1:0", "1:0 1:2", "1:1"
        args.eval_batch = 16
    if args.threads:
        torch.set_num_threads(args.threads)
    earlier = resume(args)
    chosen_arms = arms(args)
    unknown = sorted(set(args.arms or ()) - set(chosen_arms))
    if unknown:
        parser.error(f"--arms: no arm {', '.join(unknown)} (the arms: {', '.join(chosen_arms)})")
    finished = (earlier or {}).get("runs", {})
    to_run = [
        (seed, arm) for seed in args.seeds for arm in args.arms or chosen_arms if arm not in finished.get(str(seed), {})
    ]
    if earlier is not None:
        print(f"{args.out}: adding {len(to_run)} (seed, arm) runs to the {sum(map(len, finished.values()))} done")
    if earlier is not None and not to_run:
        earlier.pop("meta", None)
        earlier["summary"] = summarize(earlier)
        write_results(args.out, earlier, markdown(earlier, args), args)
        print("nothing to run: every (seed, arm) asked for is in the folder already; the summary is rewritten")
        return
    model, tokenizer, train_sentences, evaluation, description = load(args)
    pairs = {split: minimal_pairs(sentences) for split, sentences in evaluation.items()}  # always all of them
    evaluation["test"] = evaluation["test"][: args.eval_sentences]
    all_kinds = {spec: None for kinds in chosen_arms.values() if kinds for spec in kinds}
    probe = SyntaxPriorKL(kinds={spec: [0] for spec in all_kinds})
    counts = check_priors(train_sentences, probe.kind_priors, causal=True)
    print(describe_counts(counts, causal=True), flush=True)
    data = {"eval": evaluation, "pairs": pairs}
    every_head = {spec: {} for spec in all_kinds}
    for kinds in chosen_arms.values():
        for spec, chosen in (kinds or {}).items():
            for layer, heads_ in chosen.items():
                every_head[spec][layer] = sorted({*every_head[spec].get(layer, []), *heads_})
    report = earlier or {
        "setup": {
            "model": description,
            "arms": {name: kinds for name, kinds in chosen_arms.items()},
            "settings": study_settings(args),
            "kind_counts": describe_counts(counts, causal=True),
            "train_sentences_pool": len(train_sentences),
            "eval_sentences": len(evaluation["test"]),
            "quick": args.quick,
        },
        "runs": {},
        "invocations": [],
    }
    report.pop("meta", None)  # write_results puts this command's first
    done: list[str] = []
    report["invocations"].append(invocation(args, done))
    if "base" not in report:  # once per run folder
        print(f"{description}: {len(train_sentences)} training sentences; evaluating the base model", flush=True)
        report["base"] = evaluate(model, tokenizer, data, args, every_head)
        report["setup"]["pairs"] = {split: report["base"][split]["counts"] for split in data["pairs"]}
    for seed, arm in to_run:
        order = np.random.default_rng(seed).permutation(len(train_sentences))
        chosen = [train_sentences[i] for i in np.resize(order, args.steps * args.batch)]
        trained, log = train(model, tokenizer, chosen, args, seed, chosen_arms[arm])
        result = evaluate(trained, tokenizer, data, args, chosen_arms[arm])
        del trained
        log["git"] = GIT_AT_START.get("commit")
        report["runs"].setdefault(str(seed), {})[arm] = {"train": log, "eval": result}
        report["runs"] = dict(sorted(report["runs"].items(), key=lambda item: int(item[0])))
        done.append(f"{seed}/{arm}")
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
        report["summary"] = summarize(report)
        write_results(args.out, report, markdown(report, args), args)  # after every (seed, arm): resumable
    print(markdown(report, args))


if __name__ == "__main__":
    main()
