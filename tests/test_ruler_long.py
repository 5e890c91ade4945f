"""RULER prompts at long contexts fill the context asked for, or the task is refused by name: never a prompt
silently shorter (a word-level tokenizer stands in for a real one; the generators are what is tested)."""

import pytest

from mlx_knorm.quality.ruler_tasks import ALL_TASKS, make_sample


class WordTokenizer:
    """One token per whitespace-separated word: cheap, and fewer tokens per word than any subword one."""

    def encode(self, text):
        return text.split()


@pytest.mark.parametrize("task", ALL_TASKS)
def test_a_long_context_prompt_fills_the_context(task):
    context = 40_000
    sample = make_sample(task, 0, WordTokenizer(), context)
    assert context - sample.max_tokens - 64 <= len(sample.tokens) <= context - sample.max_tokens
    assert sample == make_sample(task, 0, WordTokenizer(), context)


def test_a_context_past_what_a_generator_makes_is_refused_by_name():
    with pytest.raises(ValueError, match="cwe: its generator runs out at"):
        make_sample("cwe", 0, WordTokenizer(), 200_000)
