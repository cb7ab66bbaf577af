"""GenerationConfig: frozen, hashable with lists given, one clear error per bad field."""

import dataclasses

import pytest

from attnlab.inference.config import GenerationConfig


def test_lists_are_kept_as_tuples_and_the_config_is_frozen():
    config = GenerationConfig(5, stop_tokens=[3, 4], stop_strings=["\n\n"])
    assert config.stop_tokens == (3, 4) and config.stop_strings == ("\n\n",)
    assert hash(config) == hash(GenerationConfig(5, stop_tokens=(3, 4), stop_strings=("\n\n",)))
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_new_tokens = 6


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens must be >= 1, got 0"),
        ({"stop_strings": ("",)}, "stop_strings must be non-empty strings"),
        ({"max_context": 0}, "max_context must be >= 1, got 0"),
        ({"num_beams": 0}, "num_beams must be >= 1, got 0"),
        (
            {"num_beams": 2, "num_return_sequences": 3},
            r"num_return_sequences must be in \[1, num_beams=2\]",
        ),
        ({"early_stopping": "sometimes"}, "early_stopping must be True, False or 'never'"),
    ],
)
def test_bad_fields_name_themselves(fields, message):
    with pytest.raises(ValueError, match=message):
        GenerationConfig(**fields)


def test_max_total_len_lowers_the_new_tokens_or_says_there_is_no_room():
    assert GenerationConfig(10, max_total_len=7).new_tokens_for(4) == 3
    assert GenerationConfig(2, max_total_len=70).new_tokens_for(4) == 2
    with pytest.raises(ValueError, match="max_total_len=4 leaves no room"):
        GenerationConfig(10, max_total_len=4).new_tokens_for(4)
