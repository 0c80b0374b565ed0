"""The model registry: families, presets and checkpoint directories resolve through it."""

import json
import subprocess
import sys

import pytest

from mstar.models import interfaces as I
from mstar.models import registry
from mstar.models.presets import Preset


def test_builtin_families_and_presets():
    names = {f.name for f in registry.families()}
    assert {"qwen3_5", "qwen3", "whisper"} <= names
    assert registry.family_of("qwen3.5-0.8b").name == "qwen3_5"
    assert registry.family_of("tiny-qwen3").name == "qwen3"
    assert registry.family_of("whisper-tiny").name == "whisper"
    assert I.TRANSCRIBES in registry.family_of("whisper-large-v3").capabilities
    assert I.RECURRENT_STATE in registry.family_of("tiny-qwen3.5").capabilities
    assert I.GENERATES_TOKENS not in registry.family_of("whisper-tiny").capabilities
    with pytest.raises(ValueError, match="neither a directory nor a preset"):
        registry.family_of("no-such-model")


def test_directory_by_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    assert registry.family_of(str(tmp_path)).name == "qwen3"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "x", "text_config": {"model_type": "qwen3_5_text"}}))
    assert registry.family_of(str(tmp_path)).name == "qwen3_5"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama-ish"}))
    with pytest.raises(ValueError, match="not supported"):
        registry.family_of(str(tmp_path))


def test_clashing_registration_is_refused():
    with pytest.raises(ValueError, match="already belong"):
        registry.register(registry.Family(name="impostor", model_types=("qwen3",), capabilities=frozenset()))
    with pytest.raises(ValueError, match="already belong"):
        registry.register(registry.Family(name="impostor", model_types=("imp",), capabilities=frozenset(),
                                          presets=(Preset("tiny-qwen3", "imp", {}),)))
    assert "impostor" not in {f.name for f in registry.families()}


def test_plugin_module_registers_a_family(tmp_path):
    (tmp_path / "my_plugin.py").write_text(
        "from mstar.models.registry import Family, register\n"
        "from mstar.models.presets import Preset\n"
        "register(Family(name='plug', model_types=('plug',), capabilities=frozenset({'synthesizes_speech'}),\n"
        "                presets=(Preset('plug-tiny', 'plug', {}),)))\n")
    code = ("from mstar.models import registry; f = registry.family_of('plug-tiny'); "
            "print(f.name, sorted(f.capabilities))")
    env = {"PYTHONPATH": str(tmp_path), "MSTAR_MODEL_PLUGINS": "my_plugin", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["plug", "['synthesizes_speech']"]
