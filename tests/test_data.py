"""Prompts as records: every file format and a Hugging Face dataset give the same prompts and fields, a record
without its prompt column fails in one line, and a reward sees the fields in training and in evaluation."""

from __future__ import annotations

import csv
import json
import pickle

import pytest
import torch

from gyremedia import hookimpl
from gyremedia.config import ConfigError
from gyremedia.data import Prompt, read_dataset, read_prompts
from gyremedia.plugins import PluginManager
from gyremedia.trainer import Trainer

RECORDS = [
    {"prompt": "a red circle", "tag": "single", "include": [{"class": "circle", "count": 1}]},
    {"prompt": "two blue squares", "tag": "counting", "include": [{"class": "square", "count": 2}]},
]


def write(folder, suffix: str, records: list[dict]):
    path = folder / f"prompts{suffix}"
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    elif suffix == ".json":
        path.write_text(json.dumps(records))
    elif suffix == ".csv":
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(records[0]))
            writer.writeheader()
            writer.writerows(records)
    elif suffix == ".parquet":
        import pyarrow
        import pyarrow.parquet

        pyarrow.parquet.write_table(pyarrow.Table.from_pylist(records), path)
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_record_files_give_the_text_and_the_fields(tmp_path, suffix):
    prompts = read_prompts(str(write(tmp_path, suffix, RECORDS)))
    assert prompts == ["a red circle", "two blue squares"] and all(isinstance(p, Prompt) for p in prompts)
    assert [dict(p.fields) for p in prompts] == [{k: v for k, v in r.items() if k != "prompt"} for r in RECORDS]


def test_a_csv_gives_its_columns_as_text_fields_and_a_text_file_none(tmp_path):
    prompts = read_prompts(str(write(tmp_path, ".csv", [{"question": "1+2=", "answer": "3"}])), column="question")
    assert prompts == ["1+2="] and dict(prompts[0].fields) == {"answer": "3"}
    (tmp_path / "plain.txt").write_text("a red circle\n\n two blue squares \n")
    plain = read_prompts(str(tmp_path / "plain.txt"))
    assert plain == ["a red circle", "two blue squares"] and not plain[0].fields


def test_a_prompt_is_a_string_that_keeps_its_fields_through_pickle():
    prompt = Prompt("a red circle", {"tag": "single"})
    assert prompt == "a red circle" and hash(prompt) == hash("a red circle") and json.dumps(prompt) == '"a red circle"'
    again = pickle.loads(pickle.dumps(prompt))
    assert again == prompt and dict(again.fields) == {"tag": "single"}
    with pytest.raises(TypeError):
        prompt.fields["tag"] = "changed"  # read-only: a reward cannot change another's ground truth


def test_a_saved_dataset_loads_by_split_and_column(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [{"question": r["prompt"], "tag": r["tag"]} for r in RECORDS]
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows[:1]), "test": datasets.Dataset.from_list(rows[1:])}
    ).save_to_disk(tmp_path / "set")
    prompts = read_dataset(str(tmp_path / "set"), "test", "question")
    assert prompts == ["two blue squares"] and dict(prompts[0].fields) == {"tag": "counting"}


def test_a_record_without_the_prompt_column_fails_naming_the_key_and_the_fix(make_config, tmp_path):
    path = write(tmp_path, ".jsonl", [{"caption": "a red circle"}])
    with pytest.raises(ConfigError) as error:
        make_config(f"data.prompts_file={path}")
    message = str(error.value)
    assert message.startswith(f"data.prompts_file='{path}': line 1 has no text under 'prompt'")
    assert "'caption'" in message and "data.prompt_column" in message
    make_config(f"data.prompts_file={path}", "data.prompt_column=caption")  # the fix works


class FieldReader:
    """A reward that records the fields of the prompts it is given."""

    kinds = {"image"}
    seen: list[dict] = []

    def __call__(self, media, prompts):
        FieldReader.seen.extend(dict(getattr(p, "fields", {})) for p in prompts)
        return torch.zeros(len(prompts))


def test_a_reward_sees_the_records_fields_in_training_and_in_evaluation(make_config, tmp_path):
    class Plugin:
        @hookimpl
        def gyremedia_register_rewards(self, register):
            register("field_reader", lambda context: FieldReader())

    pm = PluginManager(extra_plugins=[Plugin()])
    path = write(tmp_path, ".jsonl", RECORDS)
    FieldReader.seen = []
    config = make_config(
        f"data.prompts_file={path}",
        "data.prompts=[]",
        "rewards=[field_reader]",
        f"eval.prompts_file={path}",
        "eval.samples=4",
        "train.steps=1",
        plugins=pm,
    )
    Trainer(config, pm).train()
    tags = {seen["tag"] for seen in FieldReader.seen}
    assert tags == {"single", "counting"} and len(FieldReader.seen) > 8  # training's 8 samples and evaluations


def test_a_run_keyed_by_its_prompt_records_checkpoints(make_config, tmp_path):
    """Per-prompt reward history (DDPO's stat tracker) is keyed by the prompts: records are saved as their text."""
    path = write(tmp_path, ".jsonl", RECORDS)
    config = make_config(
        f"data.prompts_file={path}",
        "data.prompts=[]",
        "advantage.history=4",
        "advantage.min_count=2",
        "train.steps=2",
        "checkpoint.every=1",
        "eval.samples=4",
    )
    state = Trainer(config, PluginManager()).train()
    assert state.step == 2 and (tmp_path / "run" / "checkpoints").is_dir()
