"""The app chooses its task in one place (`attnreg.app.tasks.task_of`, from the data config), and nothing else in
`attnreg/app` branches on the kind of task by comparing its name; the hub data modules share their reading."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import hydra
import pytest
from omegaconf import OmegaConf

from attnreg.app.configs import CONFIG_DIR
from attnreg.app.datamodules import HubDataModule
from attnreg.app.lm import HubChatDataModule, HubLMDataModule
from attnreg.app.tasks import CHAT, CLASSIFICATION, LANGUAGE_MODEL, TASKS, task_of, task_of_summary

APP = Path(__file__).resolve().parents[1] / "attnreg" / "app"
DATA_CONFIGS = sorted(path.stem for path in (CONFIG_DIR / "data").glob("*.yaml"))
EXPECTED = {
    "agreement": CLASSIFICATION,
    "cola": CLASSIFICATION,
    "sst2": CLASSIFICATION,
    "hf_dataset": CLASSIFICATION,
    "agreement_lm": LANGUAGE_MODEL,
    "ewt_lm": LANGUAGE_MODEL,
    "text_lm": LANGUAGE_MODEL,
    "hf_lm": LANGUAGE_MODEL,
    "chat": CHAT,
    "hf_chat": CHAT,
}


def test_every_data_config_has_its_expected_task():
    assert sorted(EXPECTED) == DATA_CONFIGS  # a new data config names its task here


@pytest.mark.parametrize("option", DATA_CONFIGS)
def test_each_data_config_resolves_to_its_task_object(option):
    with hydra.initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        cfg = hydra.compose("train", [f"data={option}"])
    task = task_of(cfg)
    assert task is EXPECTED[option]
    assert task_of_summary({"task": task.name} if task.named_in_summary else {}) is task


def test_a_data_class_without_a_task_is_refused_naming_it():
    cfg = OmegaConf.create({"data": {"_target_": "attnreg.app.datamodules.TextDataset"}})
    with pytest.raises(ValueError, match=r"data._target_ attnreg.app.datamodules.TextDataset names no task"):
        task_of(cfg)


def task_comparisons(path: Path) -> list[str]:
    """Where `path` compares a task's name (or a LoRA task type) or reads a `.task` to branch on it."""
    names = {*TASKS, *(task.peft_task_type for task in TASKS.values())}
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            constants = {
                sub.value for operand in operands for sub in ast.walk(operand) if isinstance(sub, ast.Constant)
            }
            task_read = any(isinstance(sub, ast.Attribute) and sub.attr == "task" for sub in operands)
            if constants & names or task_read:
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Attribute) and node.attr == "task":
            found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Constant) and node.value in {task.peft_task_type for task in TASKS.values()}:
            found.append(f"{path.name}:{node.lineno}: {node.value!r}")
    return found


def test_no_module_of_the_app_but_tasks_branches_on_the_kind_of_task():
    found = [where for path in sorted(APP.rglob("*.py")) if path.name != "tasks.py" for where in task_comparisons(path)]
    assert found == [], "ask the run's task (attnreg.app.tasks) instead of comparing its name:\n" + "\n".join(found)


def test_the_check_finds_a_comparison_of_the_task_name(tmp_path):
    path = tmp_path / "branching.py"
    path.write_text('decoder = data.task != "classification"\nkind = "SEQ_CLS" if x else y\nif t in ("chat",): pass\n')
    assert len(task_comparisons(path)) == 4  # the comparison, its `.task`, the LoRA type, the tuple


def jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.mark.parametrize(
    "read, message",
    [
        (
            lambda files: HubDataModule("json", data_files=files, text_field="sentence").read("train"),
            r"has no column \['sentence'\]; its columns are \['text', 'label'\] "
            r"\(set data.text_field / data.label_field\)",
        ),
        (
            lambda files: HubLMDataModule("json", data_files=files, text_field="body").read("train"),
            r"has no column 'body'; its columns are \['text', 'label'\] \(set data.text_field\)",
        ),
        (
            lambda files: HubChatDataModule("json", data_files=files).read_rows("train"),
            r"has no column 'messages'; its columns are \['text', 'label'\] \(set data.messages_field\)",
        ),
    ],
)
def test_each_hub_data_module_refuses_a_missing_column_naming_its_setting(read, message, tmp_path):
    rows = jsonl(tmp_path / "rows.jsonl", [{"text": "a fine film", "label": 1}])
    with pytest.raises(KeyError, match=rf"^\"dataset 'json' split 'train' {message}\"$"):
        read({"train": rows, "validation": rows})


def test_the_hub_data_modules_name_their_rows_alike(tmp_path):
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a fine film"}]
    rows = jsonl(tmp_path / "rows.jsonl", [{"text": "a fine film", "label": 1, "messages": turns}])
    files = {"train": rows, "validation": rows}
    lm, chat = HubLMDataModule("json", data_files=files), HubChatDataModule("json", data_files=files)
    lm.read("val")
    assert lm.wheres["val"] == [row for row, _ in chat.read_rows("val")] == ["dataset json split validation row 1"]
    assert HubDataModule("json", data_files=files).read("val") == (["a fine film"], [1])
