"""AttentionMonitor in real Lightning fits, on a module without the mixin: logged values, collapse flags."""

import csv
import importlib.util
import warnings

import lightning as L
import pytest
import torch
from conftest import padded_batch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from torch.utils.data import DataLoader
from transformers import BertTokenizer

import attnreg
from attnreg.analysis import parent_accuracy
from attnreg.callbacks.monitor import AttentionMonitor, EntropyCollapseWarning
from attnreg.losses import attention_entropy
from attnreg.methods.monitor.method import AttentionMonitor as MonitorMethod
from attnreg.syntax import Sentence
from attnreg.tiny import tiny_model

VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "a", "dog", "cat", "sees", "likes", "old", "."]


def gold(sent_id: str, text: str, heads: tuple[int, ...], relations: str) -> Sentence:
    return Sentence(sent_id, tuple(text.split()), heads, tuple(relations.split()), text)


GOLD = [
    gold("g0", "the dog sees a cat .", (2, 3, 0, 5, 3, 3), "det nsubj root det obj punct"),
    gold("g1", "a old cat likes the dog", (3, 3, 4, 0, 6, 4), "det amod nsubj root det obj"),
]


class Plain(L.LightningModule):
    """A LightningModule that knows nothing of attnreg."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def batches(count):
    items = []
    for index in range(count):
        batch = padded_batch(batch=4, length=8, vocab=len(VOCAB), seed=index)
        batch["labels"] = batch["input_ids"][:, 1] % 2
        items.append(batch)
    return items


def model():
    return tiny_model("bert", head="classification", vocab=len(VOCAB), layers=2, heads=4, hidden=32)


def run(module, monitor, steps, logger=False):
    trainer = L.Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[monitor],
    )
    trainer.fit(module, DataLoader(batches(steps), batch_size=None))
    return trainer


def test_monitor_values_land_in_the_csv_logger(tmp_path):
    tokenizer = BertTokenizer(vocab={token: index for index, token in enumerate(VOCAB)})
    monitor = AttentionMonitor(every_n_steps=2, gold_sentences=GOLD, tokenizer=tokenizer)
    module = Plain(model())
    run(module, monitor, steps=4, logger=CSVLogger(tmp_path, name="run"))
    with open(next(tmp_path.rglob("metrics.csv"))) as handle:
        rows = [row for row in csv.DictReader(handle) if row.get("attnreg/attention_monitor/entropy/layer0")]
    assert [int(row["step"]) for row in rows] == [2, 4]
    last = rows[-1]
    # The check at step 4 ran on the last batch with the final weights: recompute it independently.
    network = module.model.eval()
    hub = attnreg.attach(network)
    batch = batches(4)[-1]
    with torch.no_grad(), hub.capture() as probs:
        network(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    for layer in range(2):
        entropy = attention_entropy(probs[layer], batch["attention_mask"], normalize=True)
        logged = [float(last[f"attnreg/attention_monitor/entropy/layer{layer}/head{head}"]) for head in range(4)]
        torch.testing.assert_close(torch.tensor(logged), entropy, rtol=1e-5, atol=1e-6)
        logged = float(last[f"attnreg/attention_monitor/entropy/layer{layer}"])
        assert logged == pytest.approx(float(entropy.mean()), abs=1e-6)
    accuracy = parent_accuracy(network, tokenizer, GOLD).accuracy
    key = "attnreg/attention_monitor/parent_accuracy/layer{}/head{}"
    logged = [[float(last[key.format(la, h)]) for h in range(4)] for la in range(2)]
    torch.testing.assert_close(torch.tensor(logged), accuracy, rtol=0, atol=1e-6)
    assert float(last["attnreg/attention_monitor/parent_accuracy/best"]) == pytest.approx(float(accuracy.max()))
    assert monitor.method.collapses == [] and monitor.method.entropy.shape == (2, 4)


def test_attention_on_the_first_token_against_a_direct_computation():
    """The sink share per head: on a left-padded decoder batch, the first real token is not at position 0."""
    network = tiny_model("gpt2").eval()
    monitor = MonitorMethod()  # the method object the callback wraps
    monitor.bind(network)
    batch = padded_batch(batch=3, length=7)
    batch["attention_mask"] = batch["attention_mask"].flip(-1)  # left padding
    check = monitor.check(batch, step=3)
    with torch.no_grad(), monitor.hub.capture() as probs:
        network(**batch)
    mask = batch["attention_mask"]
    for layer in range(2):
        for head in range(4):
            shares = [
                float(probs[layer][row, head, query, int(mask[row].nonzero()[0])])
                for row in range(3)
                for query in range(7)
                if mask[row, query]
            ]
            expected = sum(shares) / len(shares)
            assert float(check.first_token[layer, head]) == pytest.approx(expected, abs=1e-6)
            logged = check.metrics[f"attnreg/attention_monitor/first_token/layer{layer}/head{head}"]
            assert logged == pytest.approx(expected, abs=1e-6)
        layer_mean = check.metrics[f"attnreg/attention_monitor/first_token/layer{layer}"]
        assert layer_mean == pytest.approx(float(check.first_token[layer].mean()), abs=1e-6)
    assert monitor.first_token is check.first_token


def test_collapse_warns_on_a_collapsed_layer_and_stops_when_asked():
    network = model()
    attnreg.attach(network).set_temperature(1e-4, layers=[0])  # near one-hot attention in layer 0
    with pytest.warns(EntropyCollapseWarning, match=r"layer 0 \(0\.0") as caught:
        trainer = run(Plain(network), AttentionMonitor(every_n_steps=1, on_collapse="stop"), steps=4)
    assert "layer 1" not in str(caught[0].message)
    assert trainer.global_step == 1  # stopped at the first check


def test_no_collapse_warning_on_a_healthy_model():
    monitor = AttentionMonitor(every_n_steps=1, collapse_threshold=0.05)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = run(Plain(model()), monitor, steps=3)
    assert not [w for w in caught if issubclass(w.category, EntropyCollapseWarning)]
    assert trainer.global_step == 3 and monitor.method.collapses == []
    assert float(monitor.method.entropy.min()) > 0.5  # random heads attend broadly


def test_heatmaps_go_to_tensorboard(tmp_path):
    if not (importlib.util.find_spec("tensorboard") or importlib.util.find_spec("tensorboardX")):
        pytest.skip("the TensorBoard logger needs tensorboard or tensorboardX")
    pytest.importorskip("matplotlib")
    run(Plain(model()), AttentionMonitor(every_n_steps=2), steps=2, logger=TensorBoardLogger(tmp_path))
    events = b"".join(path.read_bytes() for path in tmp_path.rglob("events.out.tfevents*"))
    assert b"attnreg/attention_monitor/attention" in events and b"attnreg/attention_monitor/entropy/layer1" in events


def test_bad_settings_are_refused_early():
    with pytest.raises(ValueError, match="every_n_steps"):
        AttentionMonitor(every_n_steps=0)
    with pytest.raises(ValueError, match="on_collapse"):
        AttentionMonitor(on_collapse="panic")
    with pytest.raises(ValueError, match="tokenizer"):
        AttentionMonitor(gold_sentences=GOLD)


def test_gpt_oss_sinks_count_in_the_monitor_and_are_refused_by_head_statistics():
    """The monitor's entropy counts the sink as one more outcome (equal to `attention_entropy(..., sink=True)` on
    eager's probabilities); the head statistics, which do not count it yet, refuse instead of reading it wrong."""
    from attnreg.analysis import head_statistics
    from attnreg.app.task import build_tokenizer, vocabulary

    tokenizer = build_tokenizer(vocabulary())
    model = tiny_model("gpt_oss", head="causal_lm", vocab=len(tokenizer)).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)
    batch = {"input_ids": torch.tensor([[5, 6, 7, 8, 9, 10]]), "attention_mask": torch.ones(1, 6, dtype=torch.long)}
    monitor = MonitorMethod(every_n_steps=1, heatmaps=False)
    monitor.bind(model)
    check = monitor.check(batch, step=0)
    with torch.no_grad():
        eager = model(**batch, output_attentions=True).attentions
    for layer, probs in enumerate(eager):
        assert float(probs.sum(-1).max()) < 0.999  # the sink takes a share
        expected = attention_entropy(probs, batch["attention_mask"], True, True, sink=True)
        torch.testing.assert_close(check.entropy[layer], expected.float(), atol=1e-5, rtol=1e-4)
    with pytest.raises(NotImplementedError, match="sink logits"):
        head_statistics(model, tokenizer, [batch])
