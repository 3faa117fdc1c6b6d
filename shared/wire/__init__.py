"""Conversions between protobuf messages and the plain data the engine and the policies use, in one
place and both ways, so that no policy ever sees a wire message."""
