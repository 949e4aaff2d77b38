"""perf.serve's arithmetic that runs without a GPU."""
from perf.serve import exposed_by_name


def test_exposed_time_is_the_critical_path_under_overlap():
    # b starts before a ends (PDL: it waits inside its span), c after an idle gap, a twice
    spans = [("a", 0.0, 10.0), ("b", 4.0, 13.0), ("c", 20.0, 25.0), ("a", 24.0, 30.0), ("d", 26.0, 28.0)]
    got = exposed_by_name(list(reversed(spans)))  # order given does not matter: sorted by start
    assert got == {"a": (10.0 + 5.0, 2), "b": (3.0, 1), "c": (5.0, 1), "d": (0.0, 1)}
    assert sum(t for t, _ in got.values()) == 10 + 3 + 5 + 5  # the union of the spans, gaps excluded
