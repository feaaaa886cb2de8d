"""Data sets as local arrays, their public/private split and client partitions."""
