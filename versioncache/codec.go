package versioncache

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"reflect"
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

// plainJSON reports whether codec is JSONCodec and values of t hold no
// interface: encoding/json's Unmarshal then decodes them exactly as
// JSONCodec does, without its Decoder (which costs a hit about half a
// microsecond and a 512-byte buffer).
func plainJSON(codec Codec, t reflect.Type) bool {
	_, isJSON := codec.(JSONCodec)
	return isJSON && !mayHoldInterface(t, 0)
}

// mayHoldInterface reports whether a value of t can hold an interface value.
// A type nested more than 16 deep (or recursive) is assumed to.
func mayHoldInterface(t reflect.Type, depth int) bool {
	if depth > 16 {
		return true
	}
	switch t.Kind() {
	case reflect.Interface:
		return true
	case reflect.Pointer, reflect.Slice, reflect.Array, reflect.Map:
		return mayHoldInterface(t.Elem(), depth+1)
	case reflect.Struct:
		for i := range t.NumField() {
			if mayHoldInterface(t.Field(i).Type, depth+1) {
				return true
			}
		}
	}
	return false
}
