"""What misled a new user (issue 26, "Misleading, or missing a word"): every override a config's comment
shows runs, attnreg's presets compose from a user's own Hydra app, the collector says which metrics it
found, CoNLL-U without `# text`, analysis containers and errors that name their argument, decoder
analysis over reachable parents, and the counts behind a causal prior and words without a token."""

import importlib.util
import json
import re
import shlex
import warnings

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.utils import instantiate
from omegaconf import OmegaConf
from tokenizers import ByteLevelBPETokenizer, Tokenizer
from tokenizers.models import WordPiece
from tokenizers.pre_tokenizers import BertPreTokenizer
from transformers import PreTrainedTokenizerFast

from attnreg import methods
from attnreg.analysis import HeadStatistics, ParentAccuracy, SyntaxTargets, analyze
from attnreg.analysis.dependencies import predicted_heads
from attnreg.analysis.heads import STATISTICS
from attnreg.app.analyze import write_report
from attnreg.app.collect import main as collect_main
from attnreg.app.configs import CONFIG_DIR, register_resolvers
from attnreg.app.summary import format_summary
from attnreg.app.task import build_tokenizer, generate, vocabulary
from attnreg.app.train import train
from attnreg.methods.layerwise_lr import LayerwiseLR
from attnreg.syntax import CollatorStats, Sentence, SyntaxCollator, align_word_ids
from attnreg.syntax.trees import read_conllu
from attnreg.tiny import tiny_model

# -- every override a config comment or the docs show ----------------------------------------------------
# The convention: a comment shows overrides as a command line of their own, `#   attnreg-train OVERRIDES`
# (shell-quoted, a trailing `# note` allowed). Every dotted override written anywhere else in a comment
# fails `test_config_comments_show_overrides_only_as_command_lines`, so none escapes the composition test.
COMMAND = re.compile(r"#\s+attnreg-train\s(?P<overrides>.*)$")
COLLECT = re.compile(r"#\s+attnreg-collect\s")  # its --baseline KEY=VALUE names a swept value, not an override
DOTTED = re.compile(r"(?<![\w.'])(?:attnreg|data|trainer|model|module|hydra|checkpoint|logger)\.[\w.]+=")
PLUGINS = {
    "launcher=slurm": "hydra_plugins.hydra_submitit_launcher",
    "launcher=local": "hydra_plugins.hydra_submitit_launcher",
    "launcher=joblib": "hydra_plugins.hydra_joblib_launcher",
}
DOCS = CONFIG_DIR.parents[1] / "docs"
DOCS_COMMAND = re.compile(r"^\s*attnreg-train(?P<overrides>(\s.*)?)$")


def config_comments() -> list[tuple[str, int, str]]:
    """(file relative to the configs, line number, the comment's text) for every comment line; a comment ending
    in a backslash continues on the next comment line, as in a shell (joined, at the first line's number)."""
    found = []
    for path in sorted(CONFIG_DIR.rglob("*.yaml")):
        continued = False
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if "#" not in line:
                continued = False
                continue
            comment = line[line.index("#") :]
            if continued:
                name, first, text = found.pop()
                found.append((name, first, text[:-1].rstrip() + " " + comment.lstrip("#").strip()))
            else:
                found.append((str(path.relative_to(CONFIG_DIR)), number, comment))
            continued = comment.rstrip().endswith("\\")
    return found


def shown_commands() -> list[tuple[str, list[str]]]:
    """('file:line', overrides) for every `#   attnreg-train ...` comment line of the configs, and every
    command line of the docs that starts with `attnreg-train` (up to a `&&` or a `# note`)."""
    commands = []
    for name, number, comment in config_comments():
        match = COMMAND.match(comment)
        if match:
            commands.append((f"{name}:{number}", shlex.split(match["overrides"], comments=True)))
    for path in sorted(DOCS.rglob("*.md")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            match = DOCS_COMMAND.match(line)
            if match:
                overrides = shlex.split(match["overrides"].split("&&")[0], comments=True)
                commands.append((f"docs/{path.relative_to(DOCS)}:{number}", overrides))
    return commands


def first_of_sweeps(overrides: list[str]) -> list[str]:
    """A multirun's overrides as one job's: `-m` dropped, each sweep (`seed=0,1,2`) at its first value."""
    kept = [override for override in overrides if override not in ("-m", "--multirun")]
    parsed = OverridesParser.create().parse_overrides(kept)
    return [
        f"{override.get_key_element()}={next(override.sweep_string_iterator())}"
        if override.is_sweep_override()
        else raw
        for override, raw in zip(parsed, kept, strict=True)
    ]


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def test_the_configs_show_overrides_to_check():
    assert len(shown_commands()) >= 10  # the convention is used: the extraction below finds the examples


def test_config_comments_show_overrides_only_as_command_lines():
    stray = [
        f"{name}:{number}: {comment}"
        for name, number, comment in config_comments()
        if DOTTED.search(comment) and not COMMAND.match(comment) and not COLLECT.match(comment)
    ]
    assert not stray, "write overrides a comment shows as '#   attnreg-train OVERRIDES' lines:\n" + "\n".join(stray)


@pytest.mark.parametrize(("where", "overrides"), shown_commands(), ids=[where for where, _ in shown_commands()])
def test_every_command_a_config_or_the_docs_show_composes_and_instantiates(where, overrides):
    for choice, plugin in PLUGINS.items():
        if choice in overrides and not installed(plugin):
            pytest.skip(f"{where} needs {plugin}, not installed")
    register_resolvers()
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("train", first_of_sweeps(overrides), return_hydra_config=True)
    callbacks = OmegaConf.to_container(cfg.attnreg, resolve=True)
    for name, node in callbacks.items():
        assert instantiate(node) is not None, f"{where}: attnreg.{name}"
    parsed = OverridesParser.create().parse_overrides(first_of_sweeps(overrides))
    for override in parsed:  # each value arrived where it was aimed (not merged into something else)
        key = override.key_or_group.lstrip("~+")
        if override.is_delete() or "." not in key or key.startswith("hydra."):
            continue
        value, found = override.value(), OmegaConf.select(cfg, key)
        assert found is not None, f"{where}: {key}"
        if not isinstance(value, dict | list):
            assert found == value, f"{where}: {key} is {found!r}, not {value!r}"


def test_the_syntax_kl_comment_gives_a_head_map():
    register_resolvers()
    (line,) = [overrides for where, overrides in shown_commands() if where.startswith("attnreg/syntax_prior_kl.yaml")]
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("train", line)
    assert instantiate(cfg.attnreg.syntax_prior_kl).method.heads == {0: [3], 1: [4]}


# -- attnreg's presets from a user's own Hydra app ------------------------------------------------------
USER_APP = """
hydra:
  searchpath: [pkg://attnreg.app.configs]
defaults:
  - _self_
  - attnreg: none
lr: 1.0e-4
"""
PRESETS = sorted(path.stem for path in (CONFIG_DIR / "attnreg").glob("*.yaml"))


@pytest.mark.parametrize("preset", PRESETS)
def test_every_attnreg_preset_composes_and_instantiates_in_a_users_own_app(tmp_path, preset):
    (tmp_path / "app.yaml").write_text(USER_APP)
    with initialize_config_dir(str(tmp_path), version_base="1.3"):
        cfg = compose("app", [f"attnreg={preset}"])
    callbacks = {name: instantiate(node) for name, node in cfg.attnreg.items()}
    assert len(callbacks) == (2 if preset == "composable" else 0 if preset == "none" else 1)
    if preset == "layerwise_lr":  # the documented defaults without the attnreg app's module.* keys
        (llrd,) = callbacks.values()
        assert llrd.method.group_options["lr"] == 2.0e-5 and llrd.method.group_options["weight_decay"] == 0.01


def test_the_layerwise_lr_preset_follows_the_attnreg_apps_module_keys():
    register_resolvers()
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("train", ["attnreg=layerwise_lr", "module.lr=0.5", "module.weight_decay=0.2"])
    llrd = instantiate(cfg.attnreg.layerwise_lr)
    assert llrd.method.group_options["lr"] == 0.5 and llrd.method.group_options["weight_decay"] == 0.2


def test_a_users_app_can_set_the_layerwise_lr_presets_values(tmp_path):
    (tmp_path / "app.yaml").write_text(USER_APP)
    with initialize_config_dir(str(tmp_path), version_base="1.3"):
        cfg = compose("app", ["attnreg=layerwise_lr", "attnreg.layerwise_lr.lr=${lr}"])
    assert instantiate(cfg.attnreg.layerwise_lr).method.group_options["lr"] == 1.0e-4


# -- attnreg-collect says what it looked for -------------------------------------------------------------
def user_sweep(root, summaries):
    for job, summary in enumerate(summaries):
        (root / str(job) / ".hydra").mkdir(parents=True)
        (root / str(job) / ".hydra" / "overrides.yaml").write_text(f"- seed={job}\n")
        (root / str(job) / "summary.json").write_text(json.dumps(summary))
    return root


def test_collect_says_it_found_none_of_the_metrics_and_what_the_summaries_hold(tmp_path, capsys):
    sweep = user_sweep(tmp_path, [{"eval": {"f1": 0.5}, "loss": 1.0}, {"eval": {"f1": 0.7}, "loss": 0.9}])
    collect_main([str(sweep)])
    out, err = capsys.readouterr()
    assert out == "| runs |\n|---|\n| 2 |\n"  # the table has no metric column ...
    assert "none of the metrics looked for (accuracy.val, accuracy.test, accuracy.hard" in err  # ... and says so
    assert "The summaries hold: eval.f1, loss; name them with --metrics" in err
    collect_main([str(sweep), "--metrics", "eval.f1", "accuracy.val"])
    out, err = capsys.readouterr()
    assert "eval.f1" in out and "metrics found: eval.f1; in no summary.json: accuracy.val" in err
    assert json.loads((sweep / "collected.json").read_text())["missing"] == ["accuracy.val"]


# -- CoNLL-U with multiword tokens and no `# text` -------------------------------------------------------
NO_TEXT = """# sent_id = mwt
1\tI\t_\tPRON\t_\t_\t4\tnsubj\t_\t_
2-3\tdon't\t_\t_\t_\t_\t_\t_\t_\t_
2\tdo\t_\tAUX\t_\t_\t4\taux\t_\t_
3\tn't\t_\tPART\t_\t_\t4\tadvmod\t_\t_
4\tknow\t_\tVERB\t_\t_\t0\troot\t_\tSpaceAfter=No
4.1\tit\t_\tPRON\t_\t_\t_\t_\t4:obj\t_
5\t.\t_\tPUNCT\t_\t_\t4\tpunct\t_\t_

# sent_id = glued
1\tdel\t_\tADP\t_\t_\t0\troot\t_\tSpaceAfter=No
2-3\tal\t_\t_\t_\t_\t_\t_\t_\tSpaceAfter=No
2\ta\t_\tADP\t_\t_\t1\tdep\t_\t_
3\tel\t_\tDET\t_\t_\t1\tdep\t_\t_
4\t,\t_\tPUNCT\t_\t_\t1\tpunct\t_\t_

"""


def test_conllu_with_multiword_tokens_and_no_text_line_rebuilds_the_text(tmp_path):
    path = tmp_path / "mwt.conllu"
    path.write_text(NO_TEXT)
    first, second = read_conllu(path)
    assert first.text == "I don't know." and first.words == ("I", "do", "n't", "know", ".")
    assert [first.text[a:b] for a, b in first.spans] == ["I", "do", "n't", "know", "."]
    assert second.text == "delal,"  # SpaceAfter=No on a word and on a multiword token
    assert [second.text[a:b] for a, b in second.spans] == ["del", "al", "al", ","]  # "a" + "el" share "al"


# -- containers that read as collections, and errors at construction -------------------------------------
def test_head_statistics_is_a_mapping_of_statistic_names():
    stats = HeadStatistics.empty(layers=2, heads=3)
    assert list(stats) == list(STATISTICS) and len(stats) == len(STATISTICS) and "entropy" in stats
    assert {name: values.shape for name, values in stats.items()}["to_self"] == (2, 3)
    assert "nope" not in stats and stats.get("nope") is None


@pytest.mark.parametrize(
    ("multipliers", "error"),
    [
        ({"gates": -100}, r"multipliers\['gates'\] must be a finite number > 0"),
        ({3: float("nan")}, r"multipliers\[3\] must be a finite number > 0"),
        ([1.0, 0.0], r"multipliers\[1\] must be a finite number > 0"),
        ({"gate": 10}, "multipliers: 'gate' matches no layer group"),
        ("gates", "multipliers must be a dict or a list"),
    ],
)
def test_layerwise_lr_refuses_bad_multipliers_at_construction(multipliers, error):
    with pytest.raises((ValueError, KeyError, TypeError), match=error):
        LayerwiseLR(lr=1e-3, multipliers=multipliers)


def test_layerwise_lr_refuses_a_negative_weight_decay_at_construction():
    with pytest.raises(ValueError, match="weight_decay must be >= 0, got -0.1"):
        LayerwiseLR(lr=1e-3, weight_decay=-0.1)


# -- decoder analysis: reachable parents, left baselines ------------------------------------------------
def test_causal_parent_accuracy_is_over_reachable_parents_with_left_baselines():
    sentence = Sentence("s1", ("a", "b", "c", "d"), (2, 0, 2, 3), ("det", "root", "amod", "dep"), "a b c d")
    targets = SyntaxTargets.build([sentence], [align_word_ids([None, 0, 1, 2, 3], 4)], tokens=5)
    previous = torch.zeros(1, 1, 5, 5)  # a causal head on the previous token (the first token on itself)
    previous[0, 0, 0, 0] = 1.0
    previous[0, 0, torch.arange(1, 5), torch.arange(0, 4)] = 1.0
    decoder = ParentAccuracy.empty(layers=1, heads=1, causal=True)
    decoder.update({0: previous}, targets)
    # "a" -> "b" is to the right: no causal head reaches it; "c" -> "b" and "d" -> "c" are to the left
    assert decoder.words == 3 and decoder.reachable_words() == 2 and decoder.reachable_share() == 2 / 3
    assert decoder.accuracy.item() == 1.0  # both reachable parents found (not 2 of 3)
    assert decoder.reachable_words(None, "head_to_dependent") == 1
    assert decoder.baseline(1) == 0.0 and decoder.baseline(-1) == 1.0 and decoder.best_baseline() == (-1, 1.0)
    summary = decoder.summary()
    assert "right_branching" not in summary and summary["left_branching"] == 100.0
    assert summary["dependent_to_head"] == {"head": "0-0", "accuracy": 100.0, "words": 2, "share": 66.7}
    encoder = ParentAccuracy.empty(layers=1, heads=1)
    encoder.update({0: previous}, targets)
    assert encoder.reachable_words() == 3 and encoder.baseline(1) == 1 / 3 and encoder.summary()["causal"] is False


def test_a_causal_head_never_predicts_a_word_it_cannot_see():
    words = torch.zeros(1, 1, 3, 3)  # attends to nothing it can see: every score 0
    valid = torch.ones(1, 3, dtype=torch.bool)
    assert predicted_heads(words, valid, "dependent_to_head", causal=True).tolist() == [[[-1, 0, 0]]]
    assert predicted_heads(words, valid, "head_to_dependent", causal=True).tolist() == [[[1, 2, -1]]]


def test_analyze_on_a_decoder_reports_reachable_parents(tmp_path):
    tokenizer = build_tokenizer(vocabulary())
    model = tiny_model("gpt2", vocab=len(tokenizer)).eval()
    sentences = [example.sentence for example in generate(8, seed=0)]
    analysis = analyze(model, tokenizer, sentences, similarity=False)
    syntax = analysis.syntax
    assert syntax.causal and 0 < syntax.reachable_words() < syntax.words
    assert syntax.best_baseline()[0] < 0 and "right_branching" not in analysis.to_dict()["syntax"]
    out = write_report(analysis, tmp_path, model, tokenizer, sentences[0], {"model": "g", "data": "a"}, plots=False)
    text = (out / "summary.md").read_text()
    assert f"only to its left ({syntax.reachable_words()} of {syntax.words} words" in text
    assert "Right-branching" not in text


# -- a causal prior's dropped rows, and the real cause of words without a token ------------------------
KEYS = Sentence("s1", ("Keys", "rattle", "."), (2, 0, 2), ("nsubj", "root", "punct"), "Keys rattle.")


def test_a_causal_collator_counts_and_says_once_the_rows_a_decoder_cannot_use():
    collate = SyntaxCollator(build_tokenizer(["Keys", "rattle", "."]), causal=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        collate([KEYS, KEYS])
        collate([KEYS])
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "leaves out 2 of the 4 prior rows of a batch" in messages[0]
    assert collate.stats == CollatorStats(sentences=3, arcs=6, causal_rows=6, causal_rows_dropped=3)
    dense = SyntaxCollator(collate.tokenizer, prior="neighbors", causal=True)  # rows with mass on both sides stay
    with warnings.catch_warnings(record=True):
        dense([KEYS])
    assert (dense.stats.causal_rows, dense.stats.causal_rows_dropped) == (3, 1)  # only "Keys" looks right alone
    encoder = SyntaxCollator(collate.tokenizer)
    encoder([KEYS])
    assert encoder.stats.causal_rows == 0 and encoder.stats.causal_rows_dropped == 0


def test_the_app_counts_a_decoders_causal_rows_in_the_summary(tmp_path):
    register_resolvers()
    small = ["data.train=32", "data.val=16", "data.test=16", "data.hard=16", "trainer.max_epochs=1", "~logger"]
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("train", ["model=tiny_gpt2", "trainer.enable_progress_bar=false", *small])
    with pytest.warns(UserWarning, match="the causal restriction leaves out"):
        summary = train(cfg, tmp_path)
    arcs = summary["prior_arcs"]
    assert 0 < arcs["causal_rows_dropped"] < arcs["causal_rows"]
    share = arcs["causal_rows_dropped"] / arcs["causal_rows"]
    assert f"causal restriction: {arcs['causal_rows_dropped']} of {arcs['causal_rows']} prior rows left out " in (
        format_summary(summary)
    ) and f"({share:.1%}: the parent is to the right" in format_summary(summary)


BPE_CORPUS = ['He said "no." She said "yes." They said "maybe."', "The end. It is done. We left."] * 50


def byte_level_bpe() -> PreTrainedTokenizerFast:
    trainer = ByteLevelBPETokenizer()
    trainer.train_from_iterator(BPE_CORPUS, vocab_size=300, min_frequency=2, special_tokens=["<pad>"])
    return PreTrainedTokenizerFast(tokenizer_object=trainer._tokenizer, pad_token="<pad>")


def wordpiece() -> PreTrainedTokenizerFast:
    vocab = {token: index for index, token in enumerate(["[PAD]", "[UNK]", "I", "cannot", "go", "."])}
    backend = Tokenizer(WordPiece(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = BertPreTokenizer()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]")


QUOTE = Sentence(
    "q",
    ("He", "said", '"', "no", ".", '"'),
    (2, 0, 4, 2, 2, 4),
    ("nsubj", "root", "punct", "ccomp", "punct", "punct"),
    'He said "no."',
)
CANNOT = Sentence(
    "c",
    ("I", "can", "not", "go", "."),
    (4, 4, 4, 0, 4),
    ("nsubj", "aux", "advmod", "root", "punct"),
    "I cannot go.",
    spans=((0, 1), (2, 5), (5, 8), (9, 11), (11, 12)),
)


@pytest.mark.parametrize(
    ("tokenizer", "sentence", "cause", "wrong"),
    [
        (byte_level_bpe, QUOTE, "byte-level BPE merges punctuation with its neighbour", "WordPiece"),
        (wordpiece, CANNOT, "WordPiece keeps a multiword token whole, as 'cannot'", "byte-level"),
    ],
    ids=["byte_level_bpe", "wordpiece"],
)
def test_the_words_without_a_token_warning_names_the_tokenizers_real_cause(tokenizer, sentence, cause, wrong):
    collate = SyntaxCollator(tokenizer(), max_length=64)
    with pytest.warns(UserWarning, match="get no prior") as caught:
        collate([sentence])
    (message,) = [str(w.message) for w in caught]
    assert collate.stats.arcs_dropped > 0 and "shares its only token with a neighbour" in message
    assert cause in message and wrong not in message and "truncation" not in message


def test_the_words_without_a_token_warning_blames_truncation_only_when_it_cut():
    collate = SyntaxCollator(build_tokenizer(["Keys", "rattle", "."]), max_length=3)  # [CLS] Keys [SEP]
    with pytest.warns(UserWarning, match="get no prior") as caught:
        collate([KEYS])
    (message,) = [str(w.message) for w in caught]
    assert "2 of the 2 arcs of a batch get no prior: 2 cut by truncation at max_length=3." in message
    assert "shares" not in message


def test_the_run_summary_gives_a_decoders_left_baseline_over_reachable_parents():
    heads = {"sentences": 16, "supervised": {"L0H0": 0.5}, "best_head": "L1H2", "best": 0.75}
    base = {"seed": 0, "steps": 1, "train_seconds": 1.0, "attnreg": {}, "accuracy": {}, "entropy": []}
    decoder = format_summary({**base, "parent_accuracy": {**heads, "left_branching": 0.4, "reachable_share": 0.42}})
    assert "left-branching 0.400 (a decoder: over the 42.0% of words whose parent is to their left)" in decoder
    encoder = format_summary({**base, "parent_accuracy": {**heads, "right_branching": 0.3}})
    assert "right-branching 0.300" in encoder


def test_a_heads_map_naming_a_missing_layer_is_reported_as_heads():
    kl = methods.SyntaxPriorKL(heads={12: [0]})
    with pytest.raises(
        IndexError, match=r"SyntaxPriorKL: heads=\{12: \[0\]\} names layers out of range: .* 6 attention"
    ):
        kl.bind(tiny_model("bert", layers=6))


def test_the_pruned_heads_warning_reads_as_a_sentence():
    term = methods.SyntaxPriorKL(heads=[0])
    term._reported = set()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        term._report_pruned(1, None)
        term._report_pruned(0, 2)
    assert [str(w.message) for w in caught] == [
        "SyntaxPriorKL 'syntax_prior_kl': every chosen head of layer 1 was pruned, so the term no longer covers the "
        "layer",
        "SyntaxPriorKL 'syntax_prior_kl': head 2 of layer 0 was pruned, so the term no longer covers it",
    ]


# -- issue 38: clear errors ----------------------------------------------------------------------------------
def tree_file(path, sentences=1):
    words = [("the", 2, "det"), ("dogs", 3, "nsubj"), ("bark", 0, "root")]
    rows = [f"{i}\t{word}\t_\t_\t_\t_\t{head}\t{rel}\t_\t_" for i, (word, head, rel) in enumerate(words, 1)]
    path.write_text(("# text = the dogs bark\n" + "\n".join(rows) + "\n\n") * sentences)
    return path


def test_an_empty_conllu_file_is_refused_naming_the_file(tmp_path, capsys):
    from attnreg.syntax import SyntaxDataset

    (tmp_path / "train.conllu").write_text("\n")
    with pytest.raises(ValueError, match=r"train.conllu holds no sentence: an empty CoNLL-U file"):
        SyntaxDataset.from_conllu(tmp_path / "train.conllu")
    assert len(SyntaxDataset.from_conllu(tree_file(tmp_path / "dev.conllu", 2))) == 2
    from attnreg.app.analyze import main

    tokenizer = build_tokenizer(vocabulary())
    tiny_model("bert", vocab=len(tokenizer)).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    with pytest.raises(SystemExit) as stop:  # attnreg-analyze says it too, without a traceback
        main([str(tmp_path / "model"), str(tmp_path / "train.conllu"), "--out", str(tmp_path / "report")])
    assert stop.value.code == 2 and "train.conllu holds no sentence" in capsys.readouterr().err


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused_naming_both_sizes(tmp_path, capsys):
    from attnreg.app.analyze import main
    from attnreg.app.models import pretrained_classifier
    from attnreg.app.task import build_tokenizer
    from attnreg.tiny import tiny_model

    big = build_tokenizer(["the", "dogs", "bark", *(f"w{i}" for i in range(120))])  # 128 tokens
    tiny_model("bert", vocab=100).save_pretrained(tmp_path / "model")
    big.save_pretrained(tmp_path / "model")
    big.save_pretrained(tmp_path / "tokenizer")
    with pytest.raises(ValueError, match=f"the tokenizer has {len(big)} tokens but the model .* has 100 input emb"):
        pretrained_classifier(big, 2, str(tmp_path / "model"))  # before training, not an IndexError in it
    with pytest.raises(SystemExit):
        main([str(tmp_path / "model"), str(tree_file(tmp_path / "dev.conllu")), "--out", str(tmp_path / "report")])
    assert f"the tokenizer has {len(big)} tokens but the model (BertModel) has 100" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["/models/roberta-base", "./models/roberta-base", "~/no/such/model"])
def test_a_model_folder_that_does_not_exist_is_said_to_be_missing_not_a_download(tmp_path, capsys, where):
    from attnreg.app.analyze import main
    from attnreg.app.models import load_tokenizer, pretrained_classifier

    for load in (load_tokenizer, lambda name: pretrained_classifier(None, 2, name)):
        with pytest.raises(FileNotFoundError, match=f"^model {re.escape(where)}: no such folder$"):
            load(where)
    with pytest.raises(SystemExit):
        main([where, str(tree_file(tmp_path / "dev.conllu")), "--out", str(tmp_path / "report")])
    error = capsys.readouterr().err
    assert "no such folder" in error and "download" not in error


def test_training_with_a_tokenizer_that_knows_none_of_the_words_warns():
    from attnreg.app.datamodules import TextCollator
    from attnreg.app.task import build_tokenizer
    from attnreg.syntax import SyntaxCollator
    from attnreg.syntax.trees import Sentence

    sentence = Sentence("s1", ("Keys", "rattle", "."), (2, 0, 2), ("nsubj", "root", "punct"), "Keys rattle .")
    wrong, right = build_tokenizer(["x"]), build_tokenizer(["Keys", "rattle", "."])
    for collate, example in [(SyntaxCollator, sentence), (TextCollator, {"text": sentence.text, "label": 0})]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            collate(right)([example])
            quiet = len(caught)
            collator = collate(wrong)
            collator([example])
            collator([example])  # said once
        said = [str(w.message) for w in caught[quiet:]]
        assert quiet == 0 and len(said) == 1, said
        assert said[0].startswith(f"{collate.__name__}: the tokenizer cannot tokenize the text: 100% of the 3 words")


def test_from_pretrained_on_a_save_pruned_folder_points_to_load_pruned(tmp_path, capfd, caplog):
    from transformers import AutoModelForSequenceClassification

    from attnreg.methods.pruning import load_pruned, prune_heads, pruned_heads, save_pruned

    model = tiny_model("bert", head="classification")
    prune_heads(model, {0: [1, 3]})
    save_pruned(model, tmp_path)
    with pytest.raises(RuntimeError):
        AutoModelForSequenceClassification.from_pretrained(tmp_path)  # the config keeps 4 heads a layer
    report = capfd.readouterr().err + caplog.text  # transformers' load report: its handler, or pytest's capture
    assert "load_this_folder_with__attnreg_methods_pruning_load_pruned | UNEXPECTED" in report  # what a user sees
    assert pruned_heads(load_pruned(tmp_path)) == {0: (1, 3)}  # and load_pruned takes the pointer out
