package versioncache

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
)

// Codec turns cached values into bytes and back. Implementations must be safe
// for concurrent use.
//
// A value must survive Marshal then Unmarshal: a miss answers with the value
// decoded from the bytes it caches, not the loader's own, so that the miss
// and every hit after it agree. A loaded value that encodes but does not
// decode is a *CodecError. Marshal need not be deterministic (gob and
// protobuf encode maps in iteration order): Check compares decoded values
// when encodings differ.
type Codec interface {
	Marshal(v any) ([]byte, error)
	Unmarshal(data []byte, v any) error
}

// JSONCodec is the default Codec, using encoding/json. It decodes a number
// into an interface value (a map[string]any, say) as a json.Number rather than
// encoding/json's default float64, which would round an integer above 2^53
// (a 64-bit id) to one the source never held. Like all of encoding/json, it
// writes a string's invalid UTF-8 as U+FFFD: keep raw bytes in a []byte.
type JSONCodec struct{}

var _ Codec = JSONCodec{}

// Marshal implements Codec.
func (JSONCodec) Marshal(v any) ([]byte, error) { return json.Marshal(v) }

// Unmarshal implements Codec. Like json.Unmarshal, it refuses data after the
// value.
func (JSONCodec) Unmarshal(data []byte, v any) error {
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	if err := dec.Decode(v); err != nil {
		return err
	}
	if _, err := dec.Token(); err != io.EOF {
		return errTrailingData
	}
	return nil
}

var errTrailingData = errors.New("invalid character after top-level JSON value")
