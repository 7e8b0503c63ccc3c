"""A published policy version carries its model folder's tokenizer as the tokenizer's own
`save_pretrained` writes it (not a fixed list of file names), and generation_config.json as is."""

from pathlib import Path

from learner_service.publish import _copy_tokenizer

CHAT = [{"role": "system", "content": "You are a helpful agent."}, {"role": "user", "content": "Create a task called Ünïcode."},
        {"role": "assistant", "content": '<tool_call>\n{"name": "create_task", "arguments": {"title": "x"}}\n</tool_call>'}]


def test_smollm2_tokenizer_is_published_identical(tmp_path, smollm2_dir):
    from transformers import AutoTokenizer

    out = tmp_path / "v1"
    out.mkdir()
    _copy_tokenizer(Path(smollm2_dir), out)
    src, pub = AutoTokenizer.from_pretrained(smollm2_dir), AutoTokenizer.from_pretrained(out)
    assert pub.get_vocab() == src.get_vocab() and len(pub) == len(src) == 49152
    assert pub.chat_template == src.chat_template and "<|im_start|>" in pub.chat_template
    assert (pub.eos_token, pub.pad_token, pub.all_special_tokens) == (src.eos_token, src.pad_token, src.all_special_tokens)
    ids = src.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert pub.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False) == ids
    assert (out / "generation_config.json").read_bytes() == (Path(smollm2_dir) / "generation_config.json").read_bytes()


def test_files_outside_the_old_fixed_list_are_published(tmp_path, smollm2_dir):
    """A tokenizer with a named second chat template keeps it in additional_chat_templates/,
    which the old fixed list of file names did not copy."""
    from transformers import AutoTokenizer

    tool_use = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    tok.chat_template = {"default": tok.chat_template, "tool_use": tool_use}
    src, out = tmp_path / "src", tmp_path / "v1"
    tok.save_pretrained(src)
    assert (src / "additional_chat_templates" / "tool_use.jinja").is_file()
    out.mkdir()
    _copy_tokenizer(src, out)
    pub = AutoTokenizer.from_pretrained(out)
    assert pub.chat_template == {"default": tok.chat_template["default"], "tool_use": tool_use}
    assert pub.apply_chat_template(CHAT[:2], chat_template="tool_use", tokenize=False) == (
        "<system>You are a helpful agent.<user>Create a task called Ünïcode.")


def test_a_folder_without_a_tokenizer_publishes_none(tmp_path):
    out = tmp_path / "v1"
    out.mkdir()
    (tmp_path / "config.json").write_text("{}")
    _copy_tokenizer(tmp_path, out)
    assert list(out.iterdir()) == []
