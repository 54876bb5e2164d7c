package versioncache

import "encoding/json"

// Codec turns cached values into bytes and back. Implementations must be safe
// for concurrent use.
type Codec interface {
	Marshal(v any) ([]byte, error)
	Unmarshal(data []byte, v any) error
}

// JSONCodec is the default Codec, using encoding/json.
type JSONCodec struct{}

var _ Codec = JSONCodec{}

// Marshal implements Codec.
func (JSONCodec) Marshal(v any) ([]byte, error) { return json.Marshal(v) }

// Unmarshal implements Codec.
func (JSONCodec) Unmarshal(data []byte, v any) error { return json.Unmarshal(data, v) }
