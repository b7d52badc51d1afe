"""The one spread this repository prints as "mean ± sd": over the finite values, the sample standard
deviation (n - 1 in the denominator; 0 for a single value), with the range and the count. The
monitor's confidence bound, the fidelity tables and the quality report all take it from here."""
import math
import statistics


def spread(values):
    """{mean, sd, min, max, n} of the finite values of `values` (NaN for each where there is none)."""
    finite = [float(v) for v in values if not math.isnan(v)]
    if not finite:
        nan = float("nan")
        return dict(mean=nan, sd=nan, min=nan, max=nan, n=0)
    return dict(mean=statistics.fmean(finite), sd=statistics.stdev(finite) if len(finite) > 1 else 0.0,
                min=min(finite), max=max(finite), n=len(finite))
