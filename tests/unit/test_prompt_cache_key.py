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


def _count(batch):
    return [len(str(m)) for m in batch]


def test_a_fifo_or_a_link_where_the_cache_goes_is_left_alone_and_nothing_waits(tmp_path, caplog):
    # reading the cache opened a FIFO planted at its path and waited for a writer for ever
    import os
    import threading

    from mrtpo.lightning.prompt_cache import FOLDER, cached_lengths, tokenizer_key

    tok = _bert(tmp_path, do_lower_case=True)
    folder = tmp_path / "cache" / FOLDER
    folder.mkdir(parents=True)
    path = folder / f"{tokenizer_key(tok)}.json"
    victim = tmp_path / "user.json"
    victim.write_text('{"version": 1, "lengths": {}}', encoding="utf-8")
    args = (["ab", "abc"], _count, tok, tmp_path / "cache")
    for plant in (lambda: os.mkfifo(path), lambda: path.symlink_to(victim)):
        plant()
        got: list = []
        t = threading.Thread(target=lambda out=got: out.append(cached_lengths(*args)), daemon=True)
        t.start()
        t.join(120)  # a hang guard only: the call takes milliseconds
        assert not t.is_alive(), "reading the prompt-length cache waited on a FIFO"
        assert got == [([2, 3], 2)]  # both counted here, as with no cache
        assert path.is_fifo() or path.is_symlink()  # left where it was, not replaced
        assert victim.read_text(encoding="utf-8") == '{"version": 1, "lengths": {}}'
        assert "counting again" in caplog.text and "not written" in caplog.text
        caplog.clear()
        path.unlink()
