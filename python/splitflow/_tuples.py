"""A tuple rebuilt from new values in its own class: a named tuple stays one (through _make, which
takes any iterable: its class's constructor takes the fields as arguments, and a subclass may
take more), any other tuple becomes a plain one. One rule for every place splitflow rebuilds a
sample (to_torch, a process stage's field, a remote result on its way; the C++ collation of a
batch follows it too)."""


def rebuilt(x, values):
    """`values` as a tuple of x's class where it is a named tuple, else a plain tuple."""
    make = getattr(type(x), "_make", None) if type(x) is not tuple else None
    return make(values) if make is not None and hasattr(type(x), "_fields") else tuple(values)
