"""A tiny character-level tokenizer, built in code so tests and demos need no download.

Ids are fixed by construction (special tokens first, then the characters in code-point order),
so every call returns the same vocabulary::

    <pad>=0  <s>=1  </s>=2  <unk>=3  "\\n"=4  " "=5  "!"=6 ... "~"=99

Any character outside printable ASCII and newline (a tab, an accented letter) maps to ``<unk>``.
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)
CHARACTERS = ("\n", *(chr(c) for c in range(32, 127)))

# Role headers; an assistant turn ends with eos (the model learns to stop), other turns with "\n".
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% else %}{{ '\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """Build the character-level tokenizer (100 ids: 4 special tokens + 96 characters).

    Encoding text adds ``<s>`` in front, as Llama tokenizers do; ``add_special_tokens=False``
    leaves it out. Decoding joins characters without separators. The tokenizer has a chat
    template with ``<|role|>`` headers, so ``apply_chat_template`` works on ``messages``.

    Returns:
        A ``PreTrainedTokenizerFast`` that round-trips through ``save_pretrained`` /
        ``from_pretrained`` (or ``AutoTokenizer.from_pretrained``).
    """
    vocab = {token: i for i, token in enumerate((*SPECIAL_TOKENS, *CHARACTERS))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=UNK_TOKEN))
    # One pre-token per character (newline included), so WordLevel sees single characters.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    bos_id = vocab[BOS_TOKEN]
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A $B", special_tokens=[(BOS_TOKEN, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        chat_template=CHAT_TEMPLATE,
        padding_side="right",
    )
