"""Conversations with images for ``automodel train``: the embedded example, rendering through the model's
processor, the rows' pixels, and the refusals (one process, no launch).

The model is a tiny LLaVA (CLIP tower + Llama from `automodel_testing.tiny.derive_tiny_config`) saved
with its own processor (``LlavaProcessor``: a word-level tokenizer over the example's words, the CLIP
image processor at the tower's image size, and a chat template with ``{% generation %}`` markers), so
nothing comes from the network. `save_tiny_llava` is shared with the end-to-end test
(``tests/cli/test_train_vlm.py``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("PIL")


def example_words(example: Path) -> list[str]:
    """The words and punctuation of an example's conversations (the tiny tokenizer's vocabulary)."""
    found: set[str] = set()
    for file in example.glob("*.jsonl"):
        for line in file.read_text().splitlines():
            for message in json.loads(line)["messages"]:
                for part in message["content"]:
                    found.update(re.findall(r"\w+|[^\w\s]+", part.get("text") or ""))
    return sorted(found)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from automodel_all.cli.image_data import write_image_chat_example
    from automodel_all.cli.model import load_processor
    from automodel_testing.vlm import save_tiny_llava

    root = tmp_path_factory.mktemp("image_chat")
    example = write_image_chat_example(root / "example")
    model = save_tiny_llava(root / "model", example_words(example))
    return {"root": root, "example": example, "model": model, "processor": load_processor(str(model))}


def _prepare(tiny: dict[str, Any], out: str, **data: Any) -> Any:
    from automodel_all.cli.data import prepare_data
    from automodel_all.cli.sections import DataSection

    section = DataSection(**{"path": str(tiny["example"]), "seq_len": 48, **data})
    return prepare_data(section, tiny["processor"], tiny["root"] / out)


def test_a_folder_of_images_with_jsonl_becomes_padded_rows_with_pixels(tiny: dict[str, Any]) -> None:
    from automodel_all.cli.image_data import IMAGE_CHAT_SPLITS
    from automodel_all.cli.packing import ROWS_SUFFIX, model_inputs, take_rows

    prepared = _prepare(tiny, "out", eval_split="validation")
    assert (prepared.format, prepared.packing) == ("image_messages", "padded")
    rows, evaluation = prepared.train, prepared.eval
    assert (
        len(rows) == IMAGE_CHAT_SPLITS["train"][0] and len(evaluation) == IMAGE_CHAT_SPLITS["validation"][0]
    )
    processor, config = tiny["processor"], json.loads((tiny["model"] / "config.json").read_text())
    image = config["image_token_index"]
    side, patch = config["vision_config"]["image_size"], config["vision_config"]["patch_size"]
    for index in range(len(rows)):
        width = int(rows.tokens[index])
        ids, labels = rows.input_ids[index], rows.labels[index]
        # Every image placeholder expanded to one token per patch, and the pixels of one image beside them.
        assert int((ids == image).sum()) == (side // patch) ** 2
        assert rows.media[index]["pixel_values"].shape == (1, 3, side, side)
        # Targets: the assistant's answer and EOS only, never the prompt or the image; padding after.
        answer = processor.tokenizer.decode([t for t in labels.tolist() if t != -100])
        assert answer.startswith(("The ", "A ")) and answer.endswith("<eos>"), answer
        assert bool((labels[width:] == -100).all()) and bool(
            (ids[width:] == processor.tokenizer.pad_token_id).all()
        )
    # A saved and reloaded batch cuts into micro-batches by rows, pixels included.
    reloaded = type(rows).load(tiny["root"] / "out" / "data" / "train.pt")
    batch = reloaded.batch(torch.tensor([3, 1, 4, 2]))
    assert batch["pixel_values"].shape[0] == 4 and batch["pixel_values" + ROWS_SUFFIX].tolist() == [1] * 4
    second = take_rows(batch, slice(2, 4))
    assert torch.equal(
        second["pixel_values"], torch.cat([rows.media[4]["pixel_values"], rows.media[2]["pixel_values"]])
    )
    assert torch.equal(second["input_ids"], rows.input_ids[[4, 2]].long())
    assert set(model_inputs(second)) == {"input_ids", "pixel_values"}  # the model computes its positions


def test_the_embedded_example_is_a_data_source(tiny: dict[str, Any]) -> None:
    prepared = _prepare(tiny, "builtin", path="builtin:image_chat", eval_split="validation")
    assert prepared.format == "image_messages" and prepared.eval is not None
    assert (tiny["root"] / "builtin" / "data" / "image_chat" / "train.jsonl").is_file()


def test_refusals_name_the_setting(tiny: dict[str, Any], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"data\.packing=packed cannot hold records with images"):
        _prepare(tiny, "packed", packing="packed")
    with pytest.raises(ValueError, match=r"record 0: \d+ tokens .* raise data.seq_len"):
        _prepare(tiny, "short", seq_len=8)
    broken = tmp_path / "broken"
    broken.mkdir()
    record = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "image", "path": "missing.png"}, {"type": "text", "text": "Hi"}],
            },
            {"role": "assistant", "content": [{"type": "text", "text": "A red square."}]},
        ]
    }
    (broken / "train.jsonl").write_text(json.dumps(record) + "\n")
    with pytest.raises(ValueError, match=r"record 0: message 0: image 'missing.png' not found"):
        _prepare(tiny, "broken", path=str(broken))
    # A tokenizer alone cannot render images.
    from automodel_all.cli.data import prepare_data
    from automodel_all.cli.sections import DataSection

    with pytest.raises(ValueError, match=r"needs the model's processor"):
        prepare_data(
            DataSection(path=str(tiny["example"]), seq_len=48), tiny["processor"].tokenizer, tmp_path / "tok"
        )


@pytest.mark.parametrize(("sharding", "units"), [("replicate", 4), ("root", 4), ("per_layer", 9)])
def test_plan_of_a_vlm_job_freezes_the_tower_and_places_it(
    tiny: dict[str, Any], sharding: str, units: int
) -> None:
    from automodel_all.cli.main import build_parser, job_from_args
    from automodel_all.cli.plan import plan

    argv = [
        "plan", "--model", str(tiny["model"]), "--world-size", "2", "--global-batch-size", "8",
        "--set", "freeze_config.freeze_vision_tower=true",
        "--set", f"distributed.multimodal={{frozen_sharding: {sharding}}}",
    ]  # fmt: skip
    args = build_parser().parse_args(argv)
    report = plan(job_from_args(args), world_size=args.world_size)
    frozen, sharded = (
        "freeze model.vision_tower (freeze_config)",
        f"fully_shard each of {units} transformer blocks",
    )
    assert frozen in report and sharded in report and report.index(frozen) < report.index(sharded), report
    parameters = float(re.search(r"parameters +([\d.]+) MiB", report).group(1))  # type: ignore[union-attr]
    tower = sum(v.numel() * 4 for k, v in _weights(tiny["model"]).items() if "vision_tower" in k) / 2**20
    total = sum(v.numel() * 4 for v in _weights(tiny["model"]).values()) / 2**20
    # Replicated, the tower is whole on each rank; otherwise everything is halved over 2 ranks.
    expected = tower + (total - tower) / 2 if sharding == "replicate" else total / 2
    assert parameters == pytest.approx(expected, abs=0.01), report


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")
