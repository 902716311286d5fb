"""A group whose memory plan does not fit refuses to start, clearly, and leaves nothing
running."""

import subprocess
import sys

from switchyard.testing.group import short_tmp_dir
from tests.helpers.checkout import REPO_ROOT


def test_serve_refuses_a_plan_that_does_not_fit(tiny_model_dir):
    runtime = short_tmp_dir("syrf")
    proc = subprocess.run(
        [sys.executable, "-m", "switchyard.deploy.cli", "serve", "--model", str(tiny_model_dir("qwen3")),
         "--slots", "64", "--ctx", "50000000", "--runtime-dir", str(runtime),
         "--kv-dir", str(runtime / "kv"), "--port", "18999", "--log-format", "json"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    out = proc.stdout + proc.stderr
    assert "one request at full context" in out and "Lower --ctx (now 50000000)" in out
    assert "worker.refused_to_start" in out


def test_serve_refuses_an_unsupported_gguf_in_one_line(tmp_path, monkeypatch):
    """A GGUF tensor type the loader cannot read: exit status 2 at once (no restart loop), one
    line naming the type and what is supported."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from fixtures import gguf_writer
    from fixtures.tiny_models import generate_tiny_model

    real_quantize = gguf_writer.quantize

    def fake_iq4_xs(rows, qtype):  # gguf-py cannot write IQ4_XS; the loader refuses it unread
        if qtype != GGMLQuantizationType.IQ4_XS:
            return real_quantize(rows, qtype)
        size = GGML_QUANT_SIZES[qtype]
        return np.zeros((rows.shape[0], rows.shape[1] // size[0] * size[1]), np.uint8)

    monkeypatch.setitem(gguf_writer.QUANT_TYPES, "IQ4_XS", ("IQ4_XS", "Q8_0"))
    monkeypatch.setitem(gguf_writer._FILE_TYPES, "IQ4_XS", "MOSTLY_IQ4_XS")
    monkeypatch.setattr(gguf_writer, "quantize", fake_iq4_xs)
    model = generate_tiny_model(tmp_path / "iq.gguf", fmt="gguf", quant="IQ4_XS", layers=1)
    runtime = short_tmp_dir("syrg")
    proc = subprocess.run(
        [sys.executable, "-m", "switchyard.deploy.cli", "serve", "--model", str(model),
         "--runtime-dir", str(runtime), "--kv-dir", str(runtime / "kv"), "--port", "18998",
         "--log-format", "json"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("switchyard worker:")]
    assert len(lines) == 1
    assert "GGUF tensor types IQ4_XS are not supported; supported: F32, F16, BF16" in lines[0]
    assert proc.stderr.count("component.restarted") == 0
