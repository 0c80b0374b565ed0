"""`python -m mstar.ops`: the table of ops, their backends and the selection per device,
then which backend modules loaded here (and why the others did not)."""

from mstar import ops

if __name__ == "__main__":
    print(ops.format_table())
    print()
    for mod, status in ops._backends.load().items():
        print(f"{mod.rsplit('.', 1)[-1]:24} {status}")
