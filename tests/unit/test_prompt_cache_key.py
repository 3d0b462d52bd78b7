"""The prompt token-count cache's tokenizer key (issue 50 review, item 3): a slow tokenizer
(no serializable backend) was keyed by its vocabulary alone, so two with the same vocabulary
and different options (``do_lower_case``) shared counts that differ."""

from __future__ import annotations


def _bert(folder, **options):
    from transformers.models.bert.tokenization_bert_legacy import BertTokenizerLegacy

    vocab = folder / "vocab.txt"
    if not vocab.exists():
        words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", "world", "H", "##ello"]
        vocab.write_text("\n".join(words) + "\n", encoding="utf-8")
    return BertTokenizerLegacy(str(vocab), **options)  # a slow (Python) tokenizer


def test_same_vocabulary_different_options_get_different_keys(tmp_path):
    from mrtpo.lightning.prompt_cache import tokenizer_key

    lower, cased = _bert(tmp_path, do_lower_case=True), _bert(tmp_path, do_lower_case=False)
    assert lower.get_vocab() == cased.get_vocab()
    # the options change the counts, so the counts must not be shared
    assert len(lower.tokenize("Hello")) != len(cased.tokenize("Hello"))
    assert tokenizer_key(lower) != tokenizer_key(cased)


def test_the_key_does_not_depend_on_where_the_files_are(tmp_path):
    from mrtpo.lightning.prompt_cache import tokenizer_key

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, b = _bert(tmp_path / "a", do_lower_case=True), _bert(tmp_path / "b", do_lower_case=True)
    assert tokenizer_key(a) == tokenizer_key(b)
