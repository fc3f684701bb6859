"""Lightning callbacks that observe parallel training (profilers land with their issue)."""

__all__: list[str] = []
