"""ctrl+t cycles the themes in the README's order: dark, light, high-contrast, then dark again."""
from __future__ import annotations

from kvchat.app import theming

from .conftest import SIZE, make_app, ready


def test_the_theme_files_come_in_the_readme_order():
    assert list(theming.available())[:3] == ["dark", "light", "high-contrast"]


async def test_ctrl_t_cycles_dark_light_high_contrast_and_back_to_dark(fake):
    app = make_app(fake)
    seen = []
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        for _ in range(4):
            seen.append(next(n for n in ("dark", "light", "high-contrast") if app.has_class(f"theme-{n}")))
            await pilot.press("ctrl+t")
    assert seen == ["dark", "light", "high-contrast", "dark"]
