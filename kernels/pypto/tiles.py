"""Tile sizes the PyPTO kernels share: the compiler's alignment rule for cube tiles."""

CUBE_ALIGN = 16  # elements: every cube tile a multiple of it (the compiler's CheckCubeTiling refuses others; an
# unaligned tile can also surface later as "REGISTER_COPY tile shape not set")


def cube_tile(size: int, tile: int) -> int:
    """A cube tile for a dimension of `size`: `tile`, or the whole dimension when smaller, rounded up to
    CUBE_ALIGN elements."""
    return min(tile, -(-size // CUBE_ALIGN) * CUBE_ALIGN)
