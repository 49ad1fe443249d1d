"""Applications built on the engine and the model that are not the server or the CLI itself:
`quantize` (`musespark quantize`: load a model, calibrate it, write an NVFP4 checkpoint) and
`demo_tools` (the three demo tools that `musespark generate --chat --run-tools` runs).
Nothing below the engine imports this package."""
