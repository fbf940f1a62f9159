"""Command line: `refpipe run|audit|sweep|inspect|show|ls|verify`."""
