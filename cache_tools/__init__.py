"""The hidden-state cache format: manifest, writer, reader, codecs, and the dflash-cache CLI."""
