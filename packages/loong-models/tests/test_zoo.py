import pytest

from loong_models import FoundationConfig, RopeScaling, load_model_config, zoo_names

# Parameter counts of the released HF checkpoints (embeddings included, tied counted once).
RELEASED = {
    "llama2-7b": 6_738_415_616,
    "llama3-8b": 8_030_261_248,
    "llama3.2-1b": 1_235_814_400,
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-3b": 3_085_938_688,
    "qwen2.5-7b": 7_615_616_512,
    "qwen3-0.6b": 596_049_920,
    "qwen3-8b": 8_190_735_360,
}


def test_zoo_has_the_promised_models():
    promised = {"llama3-8b", "llama3.2-1b", "qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b",
                "qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "tiny"}  # fmt: skip
    assert promised <= set(zoo_names())


@pytest.mark.parametrize("name", zoo_names())
def test_every_zoo_config_composes_and_validates(name):
    cfg = load_model_config(name)
    cfg.foundation.validate()
    assert cfg.layer_backend == "auto"


@pytest.mark.parametrize("name, count", RELEASED.items())
def test_parameter_counts_match_released_models(name, count):
    assert load_model_config(name).foundation.num_parameters() == count


def test_llama32_uses_llama3_rope_scaling():
    rs = load_model_config("llama3.2-1b").foundation.rope_scaling
    assert rs is not None and rs.factor == 32.0


def test_overrides_apply_to_the_component():
    cfg = load_model_config("qwen3-0.6b", ["foundation.num_layers=2"])
    assert cfg.foundation.num_layers == 2 and cfg.foundation.family == "qwen3"


def test_unknown_zoo_name_lists_the_zoo():
    with pytest.raises(ValueError, match="available: .*qwen3-0.6b"):
        load_model_config("gpt-5")


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(hidden_size=48, num_attention_heads=6, num_query_groups=4), "num_attention_heads=6 must be a multiple of"),
        (dict(hidden_size=100, num_attention_heads=3), "set model.foundation.kv_channels"),
        (dict(rope_scaling=RopeScaling(high_freq_factor=2.0)), "high_freq_factor=4.0 only"),
    ],
)
def test_inconsistent_configs_name_the_key(fields, message):
    with pytest.raises(ValueError, match=message):
        FoundationConfig(**fields).validate()


def test_vocab_padding_is_layout_independent():
    f = FoundationConfig(vocab_size=151_936)
    assert f.padded_vocab_size(1) == f.padded_vocab_size(2) == f.padded_vocab_size(8) == 151_936
    assert FoundationConfig(vocab_size=32_001).padded_vocab_size(4) == 32_128
