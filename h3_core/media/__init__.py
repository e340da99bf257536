"""Media: tiled video decoding and encoding, mp4 writing and audio reading."""
