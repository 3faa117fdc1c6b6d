"""Bad input to `kunserve simulate`: one line on stderr naming the problem, exit code 2, nothing simulated."""

from __future__ import annotations

import pytest

from kunserve.cli.main import main
from kunserve.shared.policy.costmodel import ConServeLatencyModel, KunServeCostModel
from kunserve.shared.profile_files import Profile, write_profile


def _fails(capsys, argv: list[str], *needles: str) -> str:
    with pytest.raises(SystemExit) as exc:
        main(["simulate", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    for needle in needles:
        assert needle in err, err
    return err


def test_unknown_accelerator(capsys, tmp_path):
    _fails(capsys, ["--model", "qwen2.5-14b", "--accelerator", "TPUv9", "--out", str(tmp_path)], "unknown accelerator 'TPUv9'", "H100")


def test_unknown_model(capsys, tmp_path):
    _fails(capsys, ["--model", "gpt-9", "--accelerator", "H100", "--out", str(tmp_path)], "unknown model 'gpt-9'")


def test_a_profile_of_another_model(capsys, tmp_path):
    path = tmp_path / "profiles.json"
    write_profile(
        path,
        Profile(
            model="qwen2.5-72b",
            dtype="bfloat16",
            layers=(0, 80),
            device="cuda[H100]",
            kunserve=KunServeCostModel(1e-9, 1e-5, 1e-3),
            conserve=ConServeLatencyModel(1e-5, 1e-9),
            fit={},
            samples=[],
        ),
    )
    _fails(
        capsys,
        ["--model", "qwen2.5-14b", "--profile-file", str(path), "--gpu-memory-gib", "80", "--out", str(tmp_path)],
        "no profile of qwen2.5-14b",
        "qwen2.5-72b",
    )


def test_a_model_larger_than_its_memory(capsys, tmp_path):
    _fails(capsys, ["--model", "qwen2.5-72b", "--accelerator", "H100", "--tp", "1", "--out", str(tmp_path)], "does not fit one instance")


def test_more_memory_than_the_gpu_has(capsys, tmp_path):
    _fails(
        capsys,
        ["--model", "llama-3.1-8b", "--accelerator", "A100", "--gpu-memory-gib", "100", "--out", str(tmp_path)],
        "100 GiB per GPU",
        "80 GiB",
    )


def test_a_trace_a_real_run_would_refuse(capsys, tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text(
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "0.0,ChatGPT,10,5,15,Conversation log\n"
        "1.0,ChatGPT,-3,5,2,Conversation log\n"
    )
    _fails(
        capsys,
        ["--model", "llama-3.1-8b", "--accelerator", "H100", "--trace", str(trace), "--out", str(tmp_path)],
        f"{trace}:3: negative Request tokens",
    )


def test_a_scenario_with_an_unknown_key(capsys, tmp_path):
    scenario = tmp_path / "s.toml"
    scenario.write_text('[scenario]\nname = "x"\n[cluster]\ninstances = 2\ngpus = 4\n')
    _fails(capsys, ["--scenario", str(scenario), "--out", str(tmp_path)], "[cluster] has no key 'gpus'")


def test_a_scenario_config_key_of_the_wrong_type(capsys, tmp_path):
    scenario = tmp_path / "s.toml"
    scenario.write_text('[scenario]\nname = "x"\n[config.engine]\nmax_num_seqs = "many"\n')
    _fails(capsys, ["--scenario", str(scenario), "--out", str(tmp_path)], "max_num_seqs must be int")
