"""``lightning-sloth-generate``: greedy continuations of prompts from the model a run trained.

::

    lightning-sloth-generate RUN_DIR "reverse: hello\\n"        # a run of the app (its merged export
                                                                # if there is one, else its checkpoint)
    lightning-sloth-generate RUN_DIR --max-new-tokens 32 "upper: abc\\n" "repeat 2: xy\\n"
"""

from __future__ import annotations

import argparse

from lightning_sloth.export import load_run_model
from lightning_sloth.generation import encode_prompt, generation_mode, greedy_generate


def main(argv: list[str] | None = None) -> None:
    """``lightning-sloth-generate RUN_DIR PROMPT [PROMPT ...]``: print greedy continuations."""
    parser = argparse.ArgumentParser(
        prog="lightning-sloth-generate",
        description="Greedy-decode prompts with the model a lightning-sloth run trained.",
    )
    parser.add_argument("run_dir", help="the run's output directory (holds .hydra/ and checkpoints/)")
    parser.add_argument("prompts", nargs="+", help='prompt text; "\\n" is read as a newline')
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument(
        "--chat", action="store_true", help="wrap each prompt as a user turn in the tokenizer's chat template"
    )
    args = parser.parse_args(argv)
    model, tokenizer = load_run_model(args.run_dir)
    prompts = []
    for text in args.prompts:
        text = text.replace("\\n", "\n")
        if args.chat:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
            prompts.append(tokenizer.encode(text, add_special_tokens=False))
        else:
            prompts.append(encode_prompt(tokenizer, text))
    with generation_mode(model):
        outputs = greedy_generate(
            model, prompts, eos_token_id=tokenizer.eos_token_id, max_new_tokens=args.max_new_tokens
        )
    for text, ids in zip(args.prompts, outputs):
        print(f"{text} -> {tokenizer.decode(ids, skip_special_tokens=True)}")


if __name__ == "__main__":
    main()
