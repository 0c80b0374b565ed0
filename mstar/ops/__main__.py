"""`python -m mstar.ops`: the table of ops, their backends and the selection per device."""

from mstar import ops

if __name__ == "__main__":
    print(ops.format_table())
