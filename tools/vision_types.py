"""The docs section on transformers' image-text-to-text types (`attnlens.vision_types.coverage` of each), printed, or
written into docs/vision-language.md in place of the section there:

    python -m tools.vision_types           # print the section
    python -m tools.vision_types --write   # replace it in docs/vision-language.md
"""

from __future__ import annotations

import pathlib
import sys

import transformers

from attnlens.vision_types import coverages

PAGE = pathlib.Path(__file__).resolve().parent.parent / "docs" / "vision-language.md"
TITLE = "## Image-text-to-text types"


def section() -> str:
    found = coverages()
    by = {o: [t for t, c in found.items() if c.outcome == o] for o in ("images", "text", "none")}
    inferred = sum(found[t].family == "Inferred" for t in by["text"])
    lines = [
        TITLE,
        "",
        f"transformers {transformers.__version__} registers {len(found)} image-text-to-text types "
        "(`MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES`, what `AutoModelForImageTextToText` builds). "
        "`attnlens.vision_types.coverage(config)` says what attnlens does with each, from its config alone "
        f"(`AutoConfig.for_model(type)`): {len(by['images'])} served with images, {len(by['text'])} their language "
        f"model on text prompts only ({len(by['text']) - inferred} by a registered family, {inferred} by the common "
        f"layout `attnlens.inferred` infers on the model of the default config), {len(by['none'])} not served.",
        "",
        "- **images**: a family with a vision tower (`model.vision`) or an image layout (`model.positions`); the "
        "detail names each tower served or refused, and whether the image positions are laid out.",
        "- **text**: the language model on text prompts; prompts with images are not laid out (no tower mounted, "
        "`model.positions` refuses them). An inferred family is checked again at load on the model itself "
        "(`verify`), which can still refuse it (a tiny idefics2 with a 4-token window is refused there).",
        "- **none**: no family, and the common layout refused (the check that failed), or transformers does not "
        "build the model from the type's default config here (the error).",
        "",
        "tests/test_vlm_breadth.py holds the lists and checks a handful on tiny models built from the config "
        "classes (a text prompt's patterns equal to `output_attentions`). Regenerate this section with "
        "`python -m tools.vision_types --write`.",
        "",
        "| type | outcome | family | what, or why not |",
        "|---|---|---|---|",
    ]
    for model_type, said in found.items():
        detail = said.detail.replace("|", "\\|").replace("\n", " ")
        family = f"`{said.family}`" if said.family else ""
        lines.append(f"| `{model_type}` | {said.outcome} | {family} | {detail} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
    text = section()
    if "--write" not in argv:
        print(text)
        return
    old = PAGE.read_text() if PAGE.exists() else "# Vision-language models\n\n"
    head, _, rest = old.partition(TITLE)
    tail = rest.partition("\n## ")[2] if rest else ""
    PAGE.write_text(head.rstrip("\n") + "\n\n" + text + (f"\n## {tail}" if tail else ""))


if __name__ == "__main__":
    main(sys.argv[1:])
