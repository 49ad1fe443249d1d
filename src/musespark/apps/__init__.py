"""Applications built on the engine and the model that are not the server or the CLI itself:
`quantize` (`musespark quantize`: load a model, calibrate it, write an NVFP4 checkpoint).
Nothing below the engine imports this package."""
