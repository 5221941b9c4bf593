from __future__ import annotations

from eagle3.figures import with_error


def test_figures_print_with_their_standard_error_where_one_was_measured():
    assert with_error(2.2261, 0.0431) == "2.226 (SE 0.043)"
    assert with_error(0.9479, 0.035, signed=True) == "+0.948 (SE 0.035)"
    assert with_error(-0.1, None, signed=True) == "-0.100"
