import argparse

import pytest

from switchyard.common.settings import (
    Settings,
    SettingsError,
    add_arguments,
    from_namespace,
    parse_size,
)


def _parse(argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return from_namespace(parser.parse_args(argv))


def test_sizes():
    assert parse_size("64GiB") == 64 * 2**30
    assert parse_size("500MB") == 500 * 10**6
    assert parse_size("1.5 KiB") == 1536
    with pytest.raises(ValueError, match="not a size"):
        parse_size("lots")


def test_flags_override_toml(tmp_path):
    cfg = tmp_path / "s.toml"
    cfg.write_text('slots = 2\nkv-disk-budget = "1GiB"\nport = 9000\n')
    s = _parse(["--config", str(cfg), "--port", "9100", "--log-content"])
    assert (s.slots, s.kv_disk_budget_bytes, s.port, s.log_content) == (2, 2**30, 9100, True)


def test_to_args_reproduces_settings():
    s = Settings(slots=3, ctx=4096, log_content=True, kv_dir="/tmp/kv")
    assert _parse(s.to_args()) == s


def test_unknown_toml_key(tmp_path):
    cfg = tmp_path / "s.toml"
    cfg.write_text("slotz = 2\n")
    with pytest.raises(SettingsError, match="unknown setting 'slotz'"):
        _parse(["--config", str(cfg)])


def test_non_loopback_needs_api_key():
    with pytest.raises(SettingsError, match="--api-key is required"):
        _parse(["--host", "0.0.0.0"])
    assert _parse(["--host", "0.0.0.0", "--api-key", "k"]).host == "0.0.0.0"


def test_served_model_names_repeat_and_round_trip(tmp_path):
    assert _parse([]).served_model_name == ()
    s = _parse(["--served-model-name", "qwen", "--served-model-name", "gpt-4o", "claude"])
    assert s.served_model_name == ("qwen", "gpt-4o", "claude")
    assert _parse(s.to_args()) == s
    cfg = tmp_path / "s.toml"
    cfg.write_text('served-model-name = ["a", "b"]\n')
    assert _parse(["--config", str(cfg)]).served_model_name == ("a", "b")
    cfg.write_text('served-model-name = "solo"\n')
    assert _parse(["--config", str(cfg)]).served_model_name == ("solo",)
    with pytest.raises(SettingsError, match="served-model-name must not be empty"):
        _parse(["--served-model-name", " "])
    s = _parse(["--background-model", "local-subagents"])
    assert s.background_model == ("local-subagents",) and _parse(s.to_args()) == s
    with pytest.raises(SettingsError, match="background-model must not be empty"):
        _parse(["--background-model", ""])


def test_kv_bits_and_group_size_are_checked():
    assert (_parse(["--kv-bits", "8"]).kv_bits, _parse([]).kv_group_size) == (8, 0)
    with pytest.raises(SettingsError, match="--kv-bits must be 8 or 4"):
        _parse(["--kv-bits", "3"])
    with pytest.raises(SettingsError, match="--kv-group-size must be 32, 64 or 128"):
        _parse(["--kv-bits", "4", "--kv-group-size", "48"])


def test_max_running_sizes_the_workers_slots():
    assert _parse([]).worker_slots == 4, "0: as many as --slots"
    assert _parse(["--slots", "2", "--max-running", "12"]).worker_slots == 12
    assert _parse(["--slots", "6", "--max-running", "3"]).worker_slots == 6
    with pytest.raises(SettingsError, match="--max-running and --release-after-s must not be"):
        _parse(["--max-running", "-1"])


def test_a_draft_model_goes_with_auto_or_draft_and_a_single_worker():
    Settings(draft_model="small.gguf").validate()
    Settings(draft_model="small.gguf", speculative="draft").validate()
    with pytest.raises(SettingsError, match="--speculative draft needs --draft-model PATH"):
        Settings(speculative="draft").validate()
    for mode in ("suffix", "mtp", "off"):
        with pytest.raises(SettingsError,
                           match=f"--draft-model is unused with --speculative {mode}"):
            Settings(draft_model="small.gguf", speculative=mode).validate()
    with pytest.raises(SettingsError, match="--draft-model runs on a single worker"):
        Settings(draft_model="small.gguf", hostfile="hosts.json").validate()
    assert _parse(["--draft-model", "small.gguf"]).draft_model == "small.gguf"


def test_speculative_modes_are_checked():
    assert Settings().speculative == "auto" and Settings().num_draft_tokens == 8
    Settings(speculative="off").validate()
    Settings(speculative="suffix", num_draft_tokens=16).validate()
    # mtp is a valid setting; whether the model ships MTP heads is the worker's to say
    # (tests/integration/test_mtp.py)
    assert _parse(["--speculative", "mtp"]).speculative == "mtp"
    with pytest.raises(SettingsError,
                       match="--speculative must be one of auto, suffix, draft, mtp, off"):
        Settings(speculative="ngram").validate()
    with pytest.raises(SettingsError, match="--num-draft-tokens must be 1..64"):
        Settings(num_draft_tokens=0).validate()
