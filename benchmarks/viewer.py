"""How fast the viewer page loads and draws, and the screenshot in docs/viewing.md.

    python benchmarks/viewer.py [--tokens 1000] [--repeats 5]
    python benchmarks/viewer.py --screenshot docs/images/viewer.png --plot docs/images/plot.png

Times one layer of SmolLM2-135M (layer 10, all 9 heads) on a prompt of `--tokens` tokens, in headless Chromium
(Debian's chromium through Selenium): the page's own load time (navigation start to the end of the load event, which
includes drawing: the page draws before `load` fires) and its drawing time (`data-render-ms`: decoding the weights and
drawing every head's thumbnail and one head large). Each repeat loads the page afresh; medians are reported.
"""

from __future__ import annotations

import argparse
import io
import statistics
import tempfile
from pathlib import Path

import torch

import attnlens

LAYER = 10
TEXT = (
    "The history of the printing press begins in the fifteenth century, when movable type changed how books were "
    "made, sold and read across Europe. "
)


def browser(width: int = 1400, height: int = 1100):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", f"--window-size={width},{height}"):
        options.add_argument(argument)
    options.binary_location = "/usr/bin/chromium"
    return webdriver.Chrome(options=options, service=Service("/usr/bin/chromedriver"))


def timing(tokens: int, repeats: int) -> None:
    model = attnlens.models.smollm2()
    ids = model.tokenizer(TEXT * (tokens // 10), return_tensors="pt").input_ids[:, :tokens]
    with tempfile.TemporaryDirectory() as folder:
        page = attnlens.show(model, ids[0], LAYER).save(Path(folder) / "page.html")
        size = page.stat().st_size
        driver = browser()
        loads, draws = [], []
        try:
            for _ in range(repeats + 1):  # the first load warms the browser up
                driver.get("about:blank")
                driver.get(page.as_uri())
                loads.append(
                    driver.execute_script(
                        "const t = performance.getEntriesByType('navigation')[0]; return t.loadEventEnd - t.startTime;"
                    )
                )
                draws.append(
                    float(driver.find_element("css selector", ".attnlens-view").get_attribute("data-render-ms"))
                )
        finally:
            driver.quit()
    print(
        f"SmolLM2-135M layer {LAYER}, {ids.shape[1]} tokens x 9 heads: page {size / 2**20:.1f} MiB; "
        f"load (navigation start to load end) median {statistics.median(loads[1:]):.0f} ms, drawing median "
        f"{statistics.median(draws[1:]):.0f} ms over {repeats} loads (first load {loads[0]:.0f} ms)"
    )


def screenshot(path: Path) -> None:
    """The demo's prompt on layer 10, pointing at a cell so the tooltip shows; a small palette PNG."""
    from PIL import Image
    from selenium.webdriver.common.actions.action_builder import ActionBuilder

    model = attnlens.models.smollm2()
    prompt = "When Mary and John went to the store, John gave a drink to"
    with tempfile.TemporaryDirectory() as folder:
        page = attnlens.show(model, prompt, LAYER).save(Path(folder) / "page.html")
        driver = browser(1000, 1250)
        try:
            driver.get(page.as_uri())
            view = driver.find_element("css selector", ".attnlens-view")
            driver.execute_script(f"window.attnlens[{view.get_attribute('id')!r}].select(0, 4)")
            x, y = driver.execute_script(f"return window.attnlens[{view.get_attribute('id')!r}].cell(13, 6)")
            big = view.find_element("css selector", "canvas.al-big")
            left, top = driver.execute_script(
                "const r = arguments[0].getBoundingClientRect(); return [r.left, r.top];", big
            )
            actions = ActionBuilder(driver)
            actions.pointer_action.move_to_location(int(left + x), int(top + y))
            actions.perform()
            png = driver.get_screenshot_as_png()
        finally:
            driver.quit()
    image = Image.open(io.BytesIO(png)).convert("RGB")
    image.quantize(colors=64).save(path, optimize=True)
    print(f"{path}: {image.size[0]}x{image.size[1]}, {path.stat().st_size / 1024:.0f} KiB")


def plot_image(path: Path) -> None:
    """attnlens.plot of the same layer and prompt, as a small palette PNG."""
    from PIL import Image

    model = attnlens.models.smollm2()
    prompt = "When Mary and John went to the store, John gave a drink to"
    with tempfile.TemporaryDirectory() as folder:
        written = attnlens.plot(model, prompt, LAYER, heads=[1, 4, 8], dpi=100, out=Path(folder) / "plot.png")
        image = Image.open(written).convert("RGB")
    image.quantize(colors=128).save(path, optimize=True)
    print(f"{path}: {image.size[0]}x{image.size[1]}, {path.stat().st_size / 1024:.0f} KiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--screenshot", type=Path, help="write the docs screenshot here instead of timing")
    parser.add_argument("--plot", type=Path, help="write the docs PNG example here instead of timing")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    if args.screenshot is not None:
        screenshot(args.screenshot)
    if args.plot is not None:
        plot_image(args.plot)
    if args.screenshot is None and args.plot is None:
        timing(args.tokens, args.repeats)


if __name__ == "__main__":
    main()
