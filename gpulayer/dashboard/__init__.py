"""The live dashboard (`gpulayer dashboard`): a local web page and JSON API over the peers' STATUS."""
