"""Prometheus text from several replicas made into one: `merged` sums what adds up across processes (counters,
histogram buckets, counts of running and waiting requests, resident memory) and averages what is a fraction
(KV cache usage), so a dashboard reading one process's `/metrics` reads the deployment's the same way;
`labelled` keeps each replica's series apart under a `replica` label."""

from __future__ import annotations

from collections import OrderedDict

from prometheus_client import CollectorRegistry, Metric, generate_latest
from prometheus_client.parser import text_string_to_metric_families

# gauges that are not amounts: a fraction is averaged, a start time is the earliest, a limit the largest
_MEAN_SUFFIXES = ("_perc",)
_EARLIEST = ("process_start_time_seconds",)
_LARGEST = ("process_max_fds",)


def merged(texts: list[str], extra: list[Metric] = ()) -> str:
    """One exposition of the replicas' `texts`, with `extra` families appended."""
    families: OrderedDict[str, Metric] = OrderedDict()
    values: dict[str, OrderedDict[tuple, list[float]]] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            if family.name not in families:
                families[family.name] = Metric(family.name, family.documentation, family.type)
                values[family.name] = OrderedDict()
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                values[family.name].setdefault(key, []).append(sample.value)
    for name, family in families.items():
        for (sample_name, labels), seen in values[name].items():
            family.add_sample(sample_name, dict(labels), _combine(family, sample_name, seen))
    return _exposition([*families.values(), *extra])


def labelled(texts: dict[str, str]) -> str:
    """Every replica's series, each with the label `replica` naming its replica."""
    families: OrderedDict[str, Metric] = OrderedDict()
    for replica, text in texts.items():
        for family in text_string_to_metric_families(text):
            kept = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            for sample in family.samples:
                kept.add_sample(sample.name, {**sample.labels, "replica": replica}, sample.value)
    return _exposition(list(families.values()))


def _combine(family: Metric, sample_name: str, seen: list[float]) -> float:
    if family.type == "gauge":
        if sample_name.endswith(_MEAN_SUFFIXES):
            return sum(seen) / len(seen)
        if sample_name in _EARLIEST:
            return min(seen)
        if sample_name in _LARGEST:
            return max(seen)
    return sum(seen)


class _Families:
    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self):
        return self.families


def _exposition(families: list[Metric]) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    return generate_latest(registry).decode()
