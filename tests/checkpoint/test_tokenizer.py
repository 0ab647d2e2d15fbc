import json
import shutil
from pathlib import Path

import pytest

from lowbit.checkpoint.tokenizer import Tokenizer
from lowbit.errors import LowbitError

QWEN3 = Path(__file__).resolve().parents[2].parent / "shared" / "tokenizers" / "qwen3"
DEMO = Path(__file__).resolve().parents[2] / "lowbit" / "demo_model"


@pytest.fixture(params=["demo", "qwen3"])
def qwen3_dir(tmp_path, request):
    """A ChatML tokenizer directory: the demo model's always, the real Qwen3 one where the
    project's shared folder is beside the checkout."""
    src = DEMO if request.param == "demo" else QWEN3
    if not src.exists():
        pytest.skip(f"{src} is not beside the checkout")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, tmp_path / f)
    return tmp_path


def test_qwen3_tokenizer_round_trip_and_chat_template(qwen3_dir):
    tok = Tokenizer(qwen3_dir)
    ids = tok.encode("Hello, world! Ünïcödé 你好")
    assert tok.decode(ids) == "Hello, world! Ünïcödé 你好"
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text.startswith("<|im_start|>user\nHi<|im_end|>\n") and text.endswith("<|im_start|>assistant\n")


def test_chat_template_file_overrides_config(qwen3_dir):
    (qwen3_dir / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    assert Tokenizer(qwen3_dir).apply_chat_template([{"role": "user", "content": "x"}]) == "[x]"


def test_missing_tokenizer_and_template(qwen3_dir):
    cfg = json.loads((qwen3_dir / "tokenizer_config.json").read_text())
    cfg.pop("chat_template")
    (qwen3_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(LowbitError, match="no chat template"):
        Tokenizer(qwen3_dir).apply_chat_template([{"role": "user", "content": "x"}])
    (qwen3_dir / "tokenizer.json").unlink()
    with pytest.raises(LowbitError, match="no tokenizer.json"):
        Tokenizer(qwen3_dir)
